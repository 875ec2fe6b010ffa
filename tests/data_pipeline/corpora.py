"""Test corpora written in the exact schemas of FineWeb-Edu (parquet) and OpenWebText
(parquet / JSON lines), with real prose from the embedded corpus; and how tests read streams."""

from __future__ import annotations

import gzip
import itertools
import json
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from data_pipeline.build import open_source
from data_pipeline.config import SourceConfig
from data_pipeline.embedded import embedded_documents

FINEWEB_SCHEMA = pa.schema(
    [
        ("text", pa.string()),
        ("id", pa.string()),
        ("dump", pa.string()),
        ("url", pa.string()),
        ("file_path", pa.string()),
        ("language", pa.string()),
        ("language_score", pa.float64()),
        ("token_count", pa.int64()),
        ("score", pa.float64()),
        ("int_score", pa.int64()),
    ]
)
FINEWEB_README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/*/*
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# A FineWeb-Edu-shaped test repository
"""


NEVER = 20_000
"""Steps after which a loop waiting for the data to get somewhere fails instead of hanging
the suite (the longest waits take a few thousand)."""


def texts(n: int, offset: int = 0, chars: int = 1500) -> list[str]:
    """n distinct real-prose documents (from the embedded corpus, cut to keep tests fast)."""
    docs = embedded_documents()
    return [f"{docs[(offset + i) % len(docs)].text[:chars]} [{offset + i}]" for i in range(n)]


def fineweb_rows(n: int, offset: int = 0, chars: int = 1500) -> list[dict]:
    rows = []
    for i, text in enumerate(texts(n, offset, chars), offset):
        score = 1.0 + (i * 7 % 31) / 10  # 1.0 .. 4.0, deterministic
        rows.append(
            {
                "text": text,
                "id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, str(i))}>",
                "dump": "CC-MAIN-2024-10",
                "url": f"https://example.org/{i}",
                "file_path": f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/{i}.warc.gz",
                "language": "en",
                "language_score": 0.95,
                "token_count": len(text.split()),
                "score": score,
                "int_score": round(score),
            }
        )
    return rows


def write_fineweb(
    root: Path, files: int = 3, rows_per_file: int = 40, row_group_size: int = 15, chars: int = 1500
) -> list[dict]:
    """FineWeb-Edu's layout (README configs, data/<dump>/ and sample/10BT/NNN_00000.parquet);
    the rows of its sample-10BT config."""
    folder, dump = root / "sample" / "10BT", root / "data" / "CC-MAIN-2024-10"
    folder.mkdir(parents=True)
    dump.mkdir(parents=True)
    (root / "README.md").write_text(FINEWEB_README)  # the library resolves every config
    dump_rows = fineweb_rows(2, offset=10_000)
    pq.write_table(
        pa.Table.from_pylist(dump_rows, schema=FINEWEB_SCHEMA), dump / "000_00000.parquet"
    )
    rows = []
    for f in range(files):
        part = fineweb_rows(rows_per_file, offset=f * rows_per_file, chars=chars)
        table = pa.Table.from_pylist(part, schema=FINEWEB_SCHEMA)
        pq.write_table(table, folder / f"{f:03d}_00000.parquet", row_group_size=row_group_size)
        rows += part
    return rows


def one_row_group_files(folder: Path, sizes: Sequence[int], chars: int = 200) -> list[dict]:
    """FineWeb-Edu rows in one parquet file per size (000.parquet, ...), each a single row
    group of that many rows; the rows, in file order."""
    folder.mkdir(parents=True)
    rows, offset = [], 0
    for i, size in enumerate(sizes):
        part = fineweb_rows(size, offset=offset, chars=chars)
        table = pa.Table.from_pylist(part, schema=FINEWEB_SCHEMA)
        pq.write_table(table, folder / f"{i:03d}.parquet", row_group_size=size)
        rows, offset = rows + part, offset + size
    return rows


def corrupt_row_group(path, group: int) -> None:
    """Overwrite the data pages of one row group's text column (the footer stays intact,
    so the file opens and lists its row groups as before)."""
    column = pq.ParquetFile(path).metadata.row_group(group).column(0)
    first = column.dictionary_page_offset or column.data_page_offset
    end = first + column.total_compressed_size  # the chunk, dictionary page included
    with open(path, "r+b") as f:
        f.seek(column.data_page_offset + 4)
        f.write(b"\xba\xad\xf0\x0d" * ((end - column.data_page_offset - 8) // 4))


def write_openwebtext_jsonl(path: Path, lines: list[bytes]) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))


def jsonl_lines(docs: list[str]) -> list[bytes]:
    return [json.dumps({"text": t}).encode() for t in docs]


def source(uri: str, **fields):
    return open_source(SourceConfig(uri=uri, **fields))


def read_documents(src, split=None, validation_fraction=0.0):
    """Every document of a source in one pass in file order, and the reader's counts."""
    from data_pipeline.stream import DocumentReader, StreamSettings

    settings = StreamSettings(window=2, split=split, validation_fraction=validation_fraction)
    reader = DocumentReader(src, settings)
    return [doc for doc, *_ in reader.documents(src.units())], reader.counts


def expected_documents(tokenizer, rows: list[dict], fraction: float) -> Counter:
    """The token ids (EOS included) of the training documents among `rows`, by the id-hash
    split with `fraction` held out."""
    from data_pipeline.documents import split_of

    train = [r["text"] for r in rows if split_of(r["id"], fraction) == "train"]
    return Counter(tuple(ids) for ids in tokenizer.encode_batch(train, add_eos=True))


def heavy_tailed_rows(n: int, median: int, giants: int, giant_chars: int, seed: int = 0):
    """n FineWeb-Edu rows of real prose whose lengths vary like web text: lognormal
    characters around `median` (sigma 1: a tenth of them over 3.6x the median, some over
    10x), and `giants` rows of `giant_chars` each."""
    rng = np.random.default_rng(seed)
    prose = "\n\n".join(doc.text for doc in embedded_documents())
    lengths = np.maximum(rng.lognormal(np.log(median), 1.0, n), 20).astype(int)
    lengths[rng.choice(n, giants, replace=False)] = giant_chars
    rows, start = [], 0
    for i, length in enumerate(lengths):
        start = (start + 7919 * (i + 1)) % (len(prose) - length)
        row = fineweb_rows(1, offset=i)[0]
        row["text"] = f"{prose[start : start + length]} [{i}]"
        rows.append(row)
    return rows


def long_document_rows(n: int, median: int, seed: int = 0) -> list[dict]:
    """n FineWeb-Edu rows of real prose, each a stretch of the embedded corpus's text not
    shared with another row (while the text lasts), lognormal in length around `median`
    characters (sigma 1: a tenth of them over 3.6x the median, some over 10x)."""
    rng = np.random.default_rng(seed)
    prose = "\n\n".join(doc.text for doc in embedded_documents())
    lengths = np.maximum(rng.lognormal(np.log(median), 1.0, n), 20).astype(int)
    rows, start = [], 0
    for i, length in enumerate(lengths):
        if start + length > len(prose):
            start = 0
        row = fineweb_rows(1, offset=i)[0]
        row["text"] = f"{prose[start : start + length]} [{i}]"
        rows.append(row)
        start += length
    return rows


def write_parquet(path: Path, rows: list[dict], row_group_size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=FINEWEB_SCHEMA)
    pq.write_table(table, path, row_group_size=row_group_size)


def stream_documents(steps: list, origins: list, epoch: int | None = None) -> Counter:
    """The documents a run's windows hold (of epoch `epoch` only, if given), put together
    from the windows' pieces (each window's origin, (source, epoch, stream, step, offset,
    pieces), lists where its tokens came from: a document (its epoch first), its first
    token, how many); asserts that the pieces fill the windows and every document is whole:
    its pieces follow each other from its first token and it ends with EOS."""
    whole, begun = documents_so_far(steps, origins, epoch)
    assert not begun, f"{len(begun)} documents not read to their end"
    return whole


def documents_so_far(steps: list, origins: list, epoch: int | None = None) -> tuple:
    """(the whole documents, the beginnings of those not read to their end) of a run's
    windows (see stream_documents), each piece following the one before it."""
    documents: dict = {}
    for step_windows, step_origins in zip(steps, origins, strict=True):
        for window, origin in zip(step_windows, step_origins, strict=True):
            at = 0
            for document, first, length in origin[5]:
                if epoch is None or document[0] == epoch:
                    key = (origin[0], origin[2], document)
                    documents.setdefault(key, []).append((first, window[at : at + length]))
                at += length
            assert at == len(window), origin
    whole, begun = Counter(), []
    for pieces in documents.values():
        tokens: list[int] = []
        for first, piece in sorted(pieces):
            assert first == len(tokens)
            tokens += piece
        if tokens[-1] == EOS:
            whole[tuple(tokens)] += 1
        else:
            begun.append(tuple(tokens))
    return whole, begun


def each_once(expected: Counter, whole: Counter, begun: list) -> None:
    """Asserts that the documents read so far are `expected`, each once: whole, or (those
    still open) begun, each beginning that of a distinct expected document not read whole."""
    assert not whole - expected, "documents read that are not expected, or twice"
    missing = sorted((expected - whole).elements())
    assert len(begun) == len(missing), (len(begun), len(missing))
    for start, document in zip(sorted(begun), missing, strict=True):
        assert document[: len(start)] == start


def window_documents(origin) -> set:
    """The documents a window holds a token of, by its origin's pieces."""
    return {(origin[0], origin[2], document) for document, _, _ in origin[5]}


def documents_per_step(origins: list) -> list[int]:
    """Per step (its windows' origins), the documents with a token in it."""
    return [len(set().union(*map(window_documents, step))) for step in origins]


def around_turns(per_step: list, turns: list[int], reach: int = 5) -> list:
    """The values of the steps within `reach` of each turn (a step index)."""
    return [
        per_step[i] for t in turns for i in range(max(t - reach, 0), min(t + reach, len(per_step)))
    ]


def repeats(origins: list) -> list[int]:
    """Per step after the first, the readers (one window each a step) whose window holds a
    token of a document their previous window held."""
    return [
        sum(bool(window_documents(a) & window_documents(b)) for a, b in zip(*pair, strict=True))
        for pair in itertools.pairwise(origins)
    ]


EOS = 2


def split_after_eos(tokens: list[int]) -> tuple[list[tuple], list[int]]:
    """Complete documents (each ending with EOS) and the unfinished rest."""
    docs, start = [], 0
    for i, t in enumerate(tokens):
        if t == EOS:
            docs.append(tuple(tokens[start : i + 1]))
            start = i + 1
    return docs, tokens[start:]


def window_tokens(tokens: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """The tokens a window was read with, from its inputs and labels (padding dropped: the
    labels are IGNORE from the window's end on, the inputs 0, an id text never maps to)."""
    trained = int((labels != -100).sum())
    if trained:
        return [*tokens[:trained].tolist(), int(labels[trained - 1])]
    return [int(tokens[0])] if int(tokens[0]) else []


def step_windows(batches) -> list[list[int]]:
    """A step's windows (see window_tokens), in order."""
    pairs = (zip(tokens, labels, strict=True) for tokens, labels in batches)
    return [window_tokens(x, y) for rows in pairs for x, y in rows]


def take(data, steps):
    """`steps` training steps of a TrainData, each a list of its windows' tokens."""
    return [step_windows(data.next_step()) for _ in range(steps)]


def step_origins(data) -> list:
    """Where the last step's windows of a TrainData came from, in slot order."""
    return [o for reader in data.slots.mine for o in data.origins[reader]]


def states_equal(a, b) -> bool:
    """Nested data states equal (numpy arrays compared by value)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b
