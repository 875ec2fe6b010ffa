"""The training stream: documents -> token ids + EOS -> packed windows, per stream.

A *stream* is one (data-parallel rank, DataLoader worker) pair; stream s of S reads its
share of every source (see `Source.for_stream`), so the S streams together read every
document of an epoch exactly once. Per stream and source, `DocumentStream` yields documents
and `SourceWindows` tokenizes and packs them into windows of seq_len + 1 tokens; per stream,
`MixedWindows` draws each window from a source picked by a seeded RNG in proportion to the
weights. Every level's position is a state_dict, and a restored stream continues with
exactly the next window.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec
import numpy as np
import torch

from data_pipeline.documents import SKIP_REASONS, Document, split_of
from data_pipeline.packing import WindowPacker
from data_pipeline.tokenizer import Tokenizer

log = logging.getLogger(__name__)

READ_BATCH = 32
"""Rows read (and documents tokenized) at a time; the carry holds at most one batch's tokens."""
MIN_ROWS_FOR_SKIP_CHECK = 100
"""The skipped fraction is judged only after this many rows, not on the first bad row."""
LOGGED_SKIPS = 10
"""Skipped rows logged one by one per stream and source; later ones every 1000th."""


@dataclass(frozen=True)
class StreamSettings:
    """What every stream of a run shares."""

    window: int
    """Tokens per window: seq_len + 1 (inputs are window[:-1], labels window[1:])."""
    split: str | None = "train"
    """'train', 'validation', or None for every document."""
    validation_fraction: float = 0.0
    """Share of documents (by id hash) in the validation split."""
    seed: int = 0
    """Seed of the shard order per epoch and of the mixture."""
    max_skipped_fraction: float = 1.0
    """Error when more of a stream's rows than this are unusable."""
    epochs: int | None = None
    """Passes over the data; None: endless."""


class WindowStream(Protocol):
    """One source's windows for one stream, with its position as state."""

    counts: Counter

    def __iter__(self) -> Iterator[np.ndarray]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class DocumentStream:
    """The documents of one source that one stream reads, epoch after epoch, in batches.

    The state (epoch, the dataset's position, counts) is that after the last batch yielded:
    a consumer keeps whatever it has not used of a batch in its own state.
    """

    def __init__(self, source, stream: int, num_streams: int, settings: StreamSettings):
        self.source, self.stream, self.num_streams = source, stream, num_streams
        self.settings = settings
        self.epoch, self.position, self.counts = 0, None, Counter()
        self.in_epoch = 0  # documents yielded in this epoch

    def __iter__(self) -> Iterator[list[Document]]:
        epochs = self.settings.epochs
        while epochs is None or self.epoch < epochs:
            part = self.source.for_stream(
                self.stream, self.num_streams, self.settings.seed, self.epoch
            )
            if self.position is not None:
                part.load_state_dict(self.position)
            for batch in part.iter(batch_size=READ_BATCH):
                docs = self._documents(batch)
                self.position = part.state_dict()
                self.in_epoch += len(docs)
                yield docs
            if epochs is None and not self.in_epoch:  # else the loop would never yield
                raise ValueError(
                    f"{self.source.cfg.uri}: no {self.settings.split} documents for stream "
                    f"{self.stream} of {self.num_streams} (ranks x workers); the source is too "
                    "small or its filters reject everything"
                )
            self.epoch, self.position, self.in_epoch = self.epoch + 1, None, 0

    def _documents(self, batch: dict[str, list]) -> list[Document]:
        docs, split = [], self.settings.split
        columns = list(batch)
        for values in zip(*batch.values(), strict=True):
            row = dict(zip(columns, values, strict=True))
            self.counts["rows"] += 1
            doc = self.source.parser(row)
            if isinstance(doc, str):
                self.counts[doc] += 1
                if doc in SKIP_REASONS:
                    self._skipped(doc, row)
            elif split and split_of(doc.id, self.settings.validation_fraction) != split:
                self.counts["held_out"] += 1
            else:
                docs.append(doc)
        self.counts["documents"] += len(docs)
        return docs

    def _skipped(self, reason: str, row: dict) -> None:
        skipped = sum(self.counts[r] for r in SKIP_REASONS)
        if skipped <= LOGGED_SKIPS or skipped % 1000 == 0:
            where = row.get("where") or (
                f"row {self.counts['rows']} of stream {self.stream}/{self.num_streams}, "
                f"epoch {self.epoch}"
            )
            log.warning("%s: skipped a row (%s) at %s", self.source.cfg.uri, reason, where)
        rows, limit = self.counts["rows"], self.settings.max_skipped_fraction
        if rows >= MIN_ROWS_FOR_SKIP_CHECK and skipped > limit * rows:
            detail = ", ".join(f"{r} {self.counts[r]}" for r in SKIP_REASONS if self.counts[r])
            raise ValueError(
                f"{self.source.cfg.uri}: {skipped} of {rows} rows unusable ({detail}) in stream "
                f"{self.stream}, more than data.max_skipped_fraction={limit}"
            )

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "in_epoch": self.in_epoch,
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self.in_epoch, self.counts = state["in_epoch"], Counter(state["counts"])


class SourceWindows:
    """One source's windows for one stream: its documents, tokenized with EOS after each,
    packed into windows. The packer's carry (tokens not yet emitted) is part of the state."""

    def __init__(
        self, source, tokenizer: Tokenizer, stream: int, num_streams: int, settings: StreamSettings
    ):
        self.documents = DocumentStream(source, stream, num_streams, settings)
        self.tokenizer, self.packer = tokenizer, WindowPacker(settings.window)

    @property
    def counts(self) -> Counter:
        return self.documents.counts  # tokens are counted beside the rows

    def __iter__(self) -> Iterator[np.ndarray]:
        for docs in self.documents:
            ids = self.tokenizer.encode_batch([d.text for d in docs], add_eos=True, num_threads=1)
            tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32)
            self.counts["tokens"] += len(tokens)
            yield from self.packer.add(tokens)

    def state_dict(self) -> dict:
        return {"documents": self.documents.state_dict(), **self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.documents.load_state_dict(state["documents"])
        self.packer.load_state_dict(state)


class MixedWindows(torch.utils.data.IterableDataset):
    """One data-parallel rank's windows (int64 tensors of settings.window tokens).

    In each DataLoader worker (or the main process when there are none) it builds one
    WindowStream per source for its stream (rank x workers + worker) and draws every window
    from a source picked by a seeded RNG in proportion to the weights. A finite source that
    runs out leaves the mixture. It is Stateful for torchdata's StatefulDataLoader: state
    holds the RNG and every source's position.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        tokenizer: Tokenizer | None,
        settings: StreamSettings,
        rank: int = 0,
        world_size: int = 1,
    ):
        if len(sources) != len(weights) or not sources:
            raise ValueError("need one weight per source and at least one source")
        self.sources, self.weights = list(sources), np.asarray(weights, dtype=np.float64)
        self.tokenizer, self.settings = tokenizer, settings
        self.rank, self.world_size = rank, world_size
        for source in self.sources:  # here, in the main process, before any worker forks
            source.open(settings)
        self._stream: int | None = None
        self._loaded: dict | None = None

    def _ensure_started(self) -> None:
        """Build this stream's sources (again, if the worker identity changed)."""
        worker = torch.utils.data.get_worker_info()
        index, workers = (worker.id, worker.num_workers) if worker else (0, 1)
        stream = self.rank * workers + index
        if self._stream == stream:
            return
        if worker is not None:
            fsspec.asyn.reset_lock()  # a lock held by the parent's fsspec thread when it forked
        self._stream, num_streams = stream, self.world_size * workers
        self._windows: list[WindowStream] = [
            s.windows(self.tokenizer, stream, num_streams, self.settings) for s in self.sources
        ]
        self._rng = np.random.default_rng([self.settings.seed, stream])
        self._active = list(range(len(self.sources)))
        if self._loaded is not None:
            if self._loaded["stream"] != stream:
                raise ValueError(
                    f"data state is for stream {self._loaded['stream']}, this is stream {stream}"
                )
            self._rng.bit_generator.state = self._loaded["rng"]
            self._active = list(self._loaded["active"])
            for windows, state in zip(self._windows, self._loaded["sources"], strict=True):
                windows.load_state_dict(state)

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._ensure_started()
        iterators = [iter(w) for w in self._windows]
        while self._active:
            k = self._active[0] if len(self._active) == 1 else self._draw()
            window = next(iterators[k], None)
            if window is None:
                self._active.remove(k)
                continue
            yield torch.from_numpy(window.astype(np.int64))

    def _draw(self) -> int:
        """A source index, with probability proportional to the active sources' weights."""
        p = self.weights[self._active] / self.weights[self._active].sum()
        return self._active[self._rng.choice(len(self._active), p=p)]

    def state_dict(self) -> dict:
        self._ensure_started()
        return {
            "stream": self._stream,
            "rng": self._rng.bit_generator.state,
            "active": list(self._active),
            "sources": [w.state_dict() for w in self._windows],
            "counts": dict(self.counts()),  # a summary for logging (TrainData.stats)
        }

    def load_state_dict(self, state: dict) -> None:
        self._loaded, self._stream = state, None  # applied when the stream (re)starts

    def counts(self) -> Counter:
        """Rows, documents, skips and tokens of this stream so far, over all sources."""
        return sum((w.counts for w in self._windows), Counter())
