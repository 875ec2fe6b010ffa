"""Test corpora written in the exact schemas of FineWeb-Edu (parquet) and OpenWebText
(parquet / JSON lines), with real prose from the embedded corpus; and how tests read streams."""

from __future__ import annotations

import gzip
import itertools
import json
import uuid
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from data_pipeline.config import SourceConfig
from data_pipeline.embedded import embedded_documents
from data_pipeline.sources import open_source

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


def write_openwebtext_jsonl(path: Path, lines: list[bytes]) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines))


def jsonl_lines(docs: list[str]) -> list[bytes]:
    return [json.dumps({"text": t}).encode() for t in docs]


def source(uri: str, **fields):
    return open_source(SourceConfig(uri=uri, **fields))


def read_documents(src, split=None, validation_fraction=0.0, **settings):
    """Every document of a source in one pass of one stream, and the stream's counts."""
    from data_pipeline.stream import DocumentStream, StreamSettings

    stream = DocumentStream(
        src,
        0,
        1,
        StreamSettings(
            window=2, split=split, validation_fraction=validation_fraction, epochs=1, **settings
        ),
    )
    return [doc for batch in stream for doc in batch], stream.counts


EOS = 2


def _tag_worker(windows):
    """collate_fn run in the worker: the worker's id with its window."""
    info = torch.utils.data.get_worker_info()
    return (info.id if info else 0), windows[0]


def worker_tokens(dataset, num_workers: int) -> list[list[int]]:
    """Each worker's windows concatenated in order."""
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=1, num_workers=num_workers, collate_fn=_tag_worker
    )
    tokens = defaultdict(list)
    for worker, window in loader:
        tokens[worker] += window.tolist()
    return [tokens[w] for w in sorted(tokens)]


def split_after_eos(tokens: list[int]) -> tuple[list[tuple], list[int]]:
    """Complete documents (each ending with EOS) and the unfinished rest."""
    docs, start = [], 0
    for i, t in enumerate(tokens):
        if t == EOS:
            docs.append(tuple(tokens[start : i + 1]))
            start = i + 1
    return docs, tokens[start:]


def take(batches, n):
    """n micro-batches as lists: tokens then the last label of each row (the window)."""
    return [torch.cat([x, y[:, -1:]], dim=1).tolist() for x, y in itertools.islice(batches, n)]
