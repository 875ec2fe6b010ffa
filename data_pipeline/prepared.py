"""The offline path: pre-tokenized data in megatron-core's indexed dataset format.

`prepare` tokenizes every document of a source with N processes into DIR/train.{bin,idx}
and DIR/validation.{bin,idx} (the same id-hash split as streaming), plus the tokenizer and
meta.json. `PreparedSource` reads it back as windows through megatron-core's GPTDataset
(documents concatenated with EOS, cut into seq_len + 1 samples, globally shuffled by its
seeded shuffle index); logical reader r of R takes samples r, r + R, ... of each epoch's
order, so its position is the number of samples of megatron's global shuffle consumed,
and it mixes, shards and resumes like the streaming sources.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import shutil
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from data_pipeline.documents import split_of
from data_pipeline.errors import BadDataInput
from data_pipeline.reading import Unit, batched
from data_pipeline.sources import Source, SourceError
from data_pipeline.stream import READ_BATCH, DocumentReader, Position, StreamSettings, skip_problem
from data_pipeline.tokenizer import Tokenizer, encode_in_process, load_in_process

if TYPE_CHECKING:
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from data_pipeline.config import SourceConfig

# megatron.core is imported where it is used: it takes seconds, and only this path needs it.

SPLITS = ("train", "validation")
META = "meta.json"


def prepare(
    source: Source,
    tokenizer: Tokenizer,
    output: str | Path,
    *,
    validation_fraction: float,
    workers: int,
    max_skipped_fraction: float = 1.0,
    progress: bool = True,
) -> dict:
    """Tokenize every document of `source` into `output` with `workers` processes; returns
    the metadata (also written to output/meta.json, last, so its presence means done)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    (output / META).unlink(missing_ok=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builders = {s: IndexedDatasetBuilder(str(output / f"{s}.bin"), dtype=dtype) for s in SPLITS}
    totals: Counter = Counter()
    reader = DocumentReader(source, StreamSettings(window=2, split=None))
    documents = (batch for batch in batched(reader.documents(source.units()), READ_BATCH))
    # spawn: no inherited threads or locks; the workers import only the tokenizer module.
    # An executor, not multiprocessing.Pool: a worker that dies fails the run
    # (BrokenProcessPool) instead of leaving its result waited for forever, and leaving the
    # block joins the workers (Pool.terminate could hang at the end on a loaded machine).
    spawn = multiprocessing.get_context("spawn")
    with (
        ProcessPoolExecutor(
            workers,
            mp_context=spawn,
            initializer=load_in_process,
            initargs=(str(tokenizer.path),),
        ) as pool,
        tqdm(desc=f"prepare {source.cfg.uri}", unit="doc", disable=not progress) as bar,
    ):
        pending: deque = deque()  # bounded, so reading never runs ahead of tokenizing

        def write_oldest() -> None:
            batch, result = pending.popleft()
            tokens, lengths = result.result()
            for doc, piece in zip(batch, np.split(tokens, np.cumsum(lengths)[:-1]), strict=True):
                split = split_of(doc.id, validation_fraction)
                builders[split].add_document(piece, [len(piece)])
                totals[f"{split}_documents"] += 1
                totals[f"{split}_tokens"] += len(piece)
            bar.update(len(batch))

        for rows in documents:
            batch = [doc for doc, *_ in rows]
            pending.append((batch, pool.submit(encode_in_process, [d.text for d in batch])))
            if len(pending) >= 4 * workers:
                write_oldest()
        while pending:
            write_oldest()
    problem = skip_problem(source.cfg.uri, reader.counts, max_skipped_fraction, 0, whole=True)
    if problem:
        raise BadDataInput(problem)
    for split, builder in builders.items():
        builder.finalize(str(output / f"{split}.idx"))
    shutil.copyfile(tokenizer.path, output / "tokenizer.model")
    meta = {
        "source": source.cfg.model_dump(mode="json"),
        "tokenizer_sha256": tokenizer.sha256,
        "vocab_size": tokenizer.vocab_size,
        "validation_fraction": validation_fraction,
        "rows": dict(reader.counts),
        **totals,
    }
    (output / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


@dataclass(frozen=True)
class _TokenizerInfo:
    """What megatron's GPTDataset asks of a tokenizer (it never tokenizes here)."""

    vocab_size: int
    eod: int
    pad: int

    @property
    def unique_identifiers(self) -> dict:  # part of the key of megatron's index cache
        return {"vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}


class PreparedSource:
    """A directory written by `prepare`, read as windows of its train or validation split.

    `open()` builds megatron's sample and shuffle indices (rank 0 first, cached in DIR/cache;
    every rank must call it, in the main process: it synchronizes the ranks).
    """

    def __init__(self, cfg: SourceConfig):
        self.cfg = cfg
        self.dir = Path(cfg.uri.removeprefix("prepared:")).expanduser()
        self._datasets: dict[str, GPTDataset | None] = {}

    def __repr__(self) -> str:
        return f"PreparedSource({self.cfg.uri!r})"

    def check(self) -> None:
        if not (self.dir / META).is_file():
            raise SourceError(
                "uri", f"{self.dir} is not a finished `belief-lm prepare` output (no {META})"
            )
        for split in SPLITS:
            for ext in ("bin", "idx"):
                if not (self.dir / f"{split}.{ext}").is_file():
                    raise SourceError("uri", f"{self.dir}: {split}.{ext} is missing")

    @property
    def meta(self) -> dict:
        return json.loads((self.dir / META).read_text())

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        if self.meta["tokenizer_sha256"] != tokenizer.sha256:
            raise BadDataInput(
                f"{self.cfg.uri} was tokenized with {self.dir / 'tokenizer.model'}, not with "
                f"{tokenizer.path}: set data.tokenizer.path to the same model"
            )

    def open(self, settings: StreamSettings) -> None:
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        split = settings.split or "train"
        if split in self._datasets:
            return
        self.check()
        if not self.meta.get(f"{split}_tokens"):
            self._datasets[split] = None  # megatron cannot index an empty file
            return
        config = GPTDatasetConfig(
            random_seed=settings.seed,
            sequence_length=settings.window - 1,
            blend=([str(self.dir / split)], None),
            split="1,0,0",
            path_to_cache=str(self.dir / "cache"),
            tokenizer=_TokenizerInfo(self.meta["vocab_size"], eod=2, pad=3),
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
        )
        sizes = [None, None, None]  # one epoch of samples; later epochs reorder it ourselves
        built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
        self._datasets[split] = built[0]

    def size(self) -> int:
        """Its token count: a saved stream position is valid only for the same data."""
        return sum(self.meta.get(f"{split}_tokens", 0) for split in SPLITS)

    def samples(self, split: str = "train") -> GPTDataset | None:
        """megatron's GPTDataset of a split (None if the split is empty), as open() built it:
        its samples, shuffle and document indices."""
        if split not in self._datasets:
            raise RuntimeError(f"{self!r}.open() was not called for the {split} split")
        return self._datasets[split]

    def fingerprint(self) -> list:
        """What a saved reading position is valid for: the prepared token counts."""
        return [self.size()]

    def units(self, pieces: int = 1, split: str = "train") -> list[Unit]:
        """Ranges of the split's samples (in megatron's shuffled order), at least `pieces`
        of them where there are as many samples (open() first)."""
        samples = len(self.samples(split) or ())
        parts = min(max(pieces, 1), samples)
        bounds = [samples * k // parts for k in range(parts + 1)]
        return [Unit(-2, 0, a, b, b - a) for a, b in itertools.pairwise(bounds) if b > a]

    def tokens_per_size(self, window: int) -> float:
        """Tokens per unit size: a sample is a window."""
        return float(window)

    def stream(self, units, settings: StreamSettings, position: Position, unit_at):
        """A stream of the prepared split's samples (see PreparedStream)."""
        return PreparedStream(self.samples(settings.split or "train"), units, position, unit_at)


class PreparedStream:
    """A prepared source's stream: the samples of its units, a window each, with the
    interface and positions of `stream.SourceStream`."""

    def __init__(self, dataset: GPTDataset | None, units, position: Position, unit_at):
        self.dataset, self.units, self.unit_at = dataset, units, unit_at
        self.unit, self.row, self.unit_tokens = position.unit, position.row, position.unit_tokens
        self.read: Counter = Counter()
        self.taken = 0
        self.tallies: dict[int, list[int]] = {}
        self.first_bad = None
        self.pieces: list[tuple[tuple[int, int], int, int]] = []
        """The last window's pieces: ((list index of its unit, document), first token,
        tokens)."""

    def next_window(self) -> np.ndarray | None:
        index = self.unit_at(self.unit)
        if index is None:
            return None
        unit = self.units[index]
        sample = self.dataset[unit.start + self.row]
        window = np.concatenate([sample["tokens"].numpy(), sample["labels"][-1:].numpy()])
        pieces = sample_pieces(self.dataset, unit.start + self.row)
        self.pieces = [((self.unit, *doc), first, n) for doc, first, n in pieces]
        self.row += 1
        self.unit_tokens += len(window)
        self.taken += len(window)
        self.read["samples"] += 1
        if self.row == unit.stop - unit.start:  # the position moves on to the next unit
            self.tallies[self.unit] = [self.row, 0, self.unit_tokens]
            self.unit, self.row, self.unit_tokens = self.unit + 1, 0, 0
        return window.astype(np.int32)

    def position(self) -> Position:
        return Position(self.unit, self.row, self.unit_tokens)

    def counts(self) -> Counter:
        return Counter(self.read, tokens=self.taken)

    def finished_units(self, before: int) -> Counter:
        out = Counter()
        for k in [k for k in self.tallies if k < before]:
            rows, _, tokens = self.tallies.pop(k)
            out.update(units=1, unit_rows=rows, unit_rows2=rows * rows, unit_tokens=tokens)
        return out


def sample_pieces(dataset: GPTDataset, sample: int) -> list[tuple[tuple[int], int, int]]:
    """The documents sample `sample` of megatron's GPTDataset spans (its shuffle, sample
    and document indices, as its __getitem__ just read them): ((document,), first token,
    tokens) each."""
    beg, beg_offset = dataset.sample_index[dataset.shuffle_index[sample]]
    end, end_offset = dataset.sample_index[dataset.shuffle_index[sample] + 1]
    lengths = dataset.dataset.sequence_lengths
    pieces = []
    for i in range(int(beg), int(end) + 1):
        document = int(dataset.document_index[i])
        first = int(beg_offset) if i == beg else 0
        stop = int(end_offset) + 1 if i == end else int(lengths[document])  # (+1: the label)
        pieces.append(((document,), first, stop - first))
    return pieces
