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

import json
import multiprocessing
import shutil
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from data_pipeline.documents import split_of
from data_pipeline.sources import Source, SourceError, batched
from data_pipeline.stream import (
    READ_BATCH,
    DocumentReader,
    StreamSettings,
    Window,
    skip_problem,
    start_state,
)
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
    reader = DocumentReader(source, source.units(), StreamSettings(window=2, split=None))
    documents = (batch for batch in batched(reader.documents(), READ_BATCH))
    # spawn: no inherited threads or locks; the workers import only the tokenizer module
    context = multiprocessing.get_context("spawn")
    with (
        context.Pool(workers, initializer=load_in_process, initargs=(str(tokenizer.path),)) as pool,
        tqdm(desc=f"prepare {source.cfg.uri}", unit="doc", disable=not progress) as bar,
    ):
        pending: deque = deque()  # bounded, so reading never runs ahead of tokenizing

        def write_oldest() -> None:
            batch, result = pending.popleft()
            tokens, lengths = result.get()
            for doc, piece in zip(batch, np.split(tokens, np.cumsum(lengths)[:-1]), strict=True):
                split = split_of(doc.id, validation_fraction)
                builders[split].add_document(piece, [len(piece)])
                totals[f"{split}_documents"] += 1
                totals[f"{split}_tokens"] += len(piece)
            bar.update(len(batch))

        for rows in documents:
            batch = [doc for doc, *_ in rows]
            pending.append((batch, pool.apply_async(encode_in_process, ([d.text for d in batch],))))
            if len(pending) >= 4 * workers:
                write_oldest()
        while pending:
            write_oldest()
    problem = skip_problem(source.cfg.uri, reader.counts, max_skipped_fraction, 0, whole=True)
    if problem:
        raise ValueError(problem)
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
            raise ValueError(
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

    def stream(self, reader: int, settings: StreamSettings, state: dict | None = None):
        """Logical reader `reader`'s windows of the prepared split (see PreparedStream)."""
        return PreparedStream(self.samples(settings.split or "train"), reader, settings, state)


class PreparedStream:
    """A prepared source's windows for one logical reader: samples r, r + R, ... of each
    epoch's order (epoch 0: megatron's shuffle; later epochs: a seeded permutation of it),
    with the same interface and states as `stream.SourceStream`."""

    def __init__(self, dataset: GPTDataset | None, reader: int, settings, state=None):
        self.dataset, self.reader, self.settings = dataset, reader, settings
        self.state = dict(state or start_state())

    def _share(self, epoch: int) -> np.ndarray:
        size = len(self.dataset or ())
        order = np.arange(size) if epoch == 0 else (
            np.random.default_rng([self.settings.seed, epoch]).permutation(size)
        )  # fmt: skip
        return order[self.reader :: self.settings.readers]

    def windows(self, epochs: int | None = None) -> Iterator[Window]:
        epoch, index = self.state["epoch"], self.state.get("index", 0)
        counts = Counter(self.state["counts"])
        while epochs is None or epoch < epochs:
            share = self._share(epoch)
            if not len(share):
                yield Window(np.empty(0, np.int32), True, _prepared(epoch + 1, 0, counts))
            while index < len(share):
                sample = self.dataset[int(share[index])]
                window = np.concatenate([sample["tokens"].numpy(), sample["labels"][-1:].numpy()])
                index += 1
                counts["tokens"] += len(window)
                counts["samples"] += 1
                last = index == len(share)
                state = _prepared(epoch + 1, 0, counts) if last else _prepared(epoch, index, counts)
                yield Window(window.astype(np.int32), last, state)
            epoch, index = epoch + 1, 0


def _prepared(epoch: int, index: int, counts) -> dict:
    return {"epoch": epoch, "index": index, "counts": dict(counts)}
