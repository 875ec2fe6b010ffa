"""The training stream: logical readers, global epochs, packed windows, exact positions.

A run has a fixed number R of *logical readers* (`data.readers`, by default one per
sequence of the global batch). Every training step takes G/R windows from every reader
(G = train.global_batch_size) in reader order, so global batch k is a function of k alone;
data-parallel rank d serves readers [d R/DP, (d+1) R/DP) and its DataLoader workers split
those further. Nothing about the data depends on DP, the workers or TP/PP: a checkpoint's
data state (every reader's position) continues at any layout whose DP divides R.

Epochs are global. Each source's units (`sources.Unit`: parquet row ranges, byte ranges,
files) are put in a seeded order per epoch and dealt to the readers by size (the least
loaded reader takes the next unit), so every document of an epoch is read by exactly one
reader. A reader that has read its share stops contributing to that source: its slots
become padding (inputs masked out of the loss) until every reader has finished the epoch,
and only then does epoch e + 1 begin, for all readers at the same step (agreed between
the data-parallel ranks by one small all-reduce per step, `loader.TrainData`). Balanced
shares keep that tail short; only each reader's final window of an epoch may be short.

Within a reader, each source is its own `SourceStream`: rows -> documents (`RowParser`;
corrupt, non-UTF-8 and empty rows are skipped and counted) -> sentencepiece ids + EOS ->
windows of seq_len + 1 tokens. Each window carries the stream's position after it, as
(epoch, unit, row, token): where the next window starts. Restoring a position re-reads
that row, tokenizes it and drops the tokens already used, so a resumed stream continues
with exactly the next window; positions are small and layout-free. Mixtures choose the
source of global slot n by a Weyl sequence over the weights: every step holds each
source's share of the batch to within a window, and the proportions are exact in the limit.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from data_pipeline.documents import SKIP_REASONS, Document, split_of
from data_pipeline.sources import RETRIES, DataFault, Source, Unit, failure_kind, retry_pause
from data_pipeline.tokenizer import Tokenizer

log = logging.getLogger(__name__)

READ_BATCH = 32
"""Documents tokenized at a time (one sentencepiece call)."""
LOGGED_SKIPS = 10
"""Skipped rows logged one by one per stream; later ones every 1000th."""
UNITS_PER_READER = 8
"""Units are cut to at most 1/(readers x this) of a source, so that dealt largest first
(epoch_shares) the readers' shares differ by at most one such unit. Not finer: pieces of
one parquet row group each decode the rows before them."""
STUCK_ROWS = 10_000
"""A stream that read this many rows without one document stops the run (the fair,
global skip check needs documents to flow)."""
_PHI = (math.sqrt(5) - 1) / 2
SKIPPED = (*SKIP_REASONS, "corrupt_row_group")
"""Counted as unusable rows: what data.max_skipped_fraction limits."""


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
    """Seed of each epoch's unit order."""
    readers: int = 1
    """Logical readers of the run."""
    on_corrupt_row_group: str = "skip"
    """'skip' (count its rows as skipped) or 'stop' (a DataFault)."""
    threads: int = 1
    """sentencepiece threads per tokenization call (-1: all cores)."""


@dataclass
class Window:
    """One window of a stream and the stream's state after it."""

    tokens: np.ndarray
    """int32 token ids; shorter than StreamSettings.window only at the end of an epoch."""
    last: bool
    """The stream's last window of its share of this epoch."""
    state: dict
    """Where the stream continues: {'epoch', 'unit', 'row', 'token', 'counts'}."""


def start_state() -> dict:
    return {"epoch": 0, "unit": 0, "row": 0, "token": 0, "counts": {}}


SKIP_CONFIDENCE_Z = 3.0
"""How sure the skip check must be that a source is worse than its limit (standard
deviations of the binomial estimate; 3: about 1 in 700 false stops)."""


def skip_problem(
    uri: str, counts, max_fraction: float, min_rows: int, whole: bool = False
) -> str | None:
    """Why a source must stop: too many unusable rows. Judged on its cumulative counts,
    never on fewer than `min_rows` rows: a read in progress stops only when even the lower
    confidence bound of its unusable share (Wilson score) is above the limit, so an early
    cluster of bad rows in a clean corpus does not stop it; a `whole` read (every row of
    the source) compares its exact share."""
    rows = counts.get("rows", 0)
    skipped = sum(counts.get(reason, 0) for reason in SKIPPED)
    if not rows or (rows < min_rows and not whole):
        return None
    share = skipped / rows
    if not whole:
        z2 = SKIP_CONFIDENCE_Z**2
        spread = SKIP_CONFIDENCE_Z * math.sqrt(share * (1 - share) / rows + z2 / (4 * rows**2))
        share = (share + z2 / (2 * rows) - spread) / (1 + z2 / rows)
    if share <= max_fraction:
        return None
    detail = ", ".join(f"{r} {counts[r]}" for r in SKIPPED if counts.get(r))
    return (
        f"{uri}: {skipped} of {rows} rows unusable ({detail}), more than "
        f"data.max_skipped_fraction={max_fraction}"
    )


def stream_for(source, tokenizer: Tokenizer | None, reader: int, settings, state=None):
    """Logical reader `reader`'s stream of `source` (prepared data has its own)."""
    if not isinstance(source, Source):
        return source.stream(reader, settings, state)
    units = source.units(settings.readers * UNITS_PER_READER)
    return SourceStream(source, units, tokenizer, reader, settings, state)


def epoch_shares(units: Sequence[Unit], readers: int, seed: int, epoch: int) -> list[list[int]]:
    """Unit indices of each reader in epoch `epoch`, in reading order. The units are dealt
    largest first, each to the reader with the least size so far (LPT: shares end up
    within a small unit of each other), and each reader reads its own in a seeded order
    that changes every epoch."""
    rank = np.empty(len(units), dtype=np.int64)
    rank[np.random.default_rng([seed, epoch]).permutation(len(units))] = np.arange(len(units))
    loads, shares = [0] * readers, [[] for _ in range(readers)]
    for index in sorted(range(len(units)), key=lambda i: (-units[i].size, rank[i])):
        reader = loads.index(min(loads))
        shares[reader].append(index)
        loads[reader] += units[index].size
    return [sorted(share, key=lambda i: rank[i]) for share in shares]


def slot_source(slot: int, weights: Sequence[float]) -> int:
    """The source of global window slot `slot` of a mixture: the interval of the
    cumulative weights holding frac((slot + 1) x phi) (a Weyl sequence: low discrepancy,
    so any run of slots holds each source's share up to a few windows)."""
    if len(weights) == 1:
        return 0
    total = sum(weights)
    bounds = list(itertools.accumulate(w / total for w in weights))
    return min(bisect.bisect_right(bounds, ((slot + 1) * _PHI) % 1.0), len(weights) - 1)


class DocumentReader:
    """The documents of a list of units from a position (unit, row), with counts of rows,
    documents, filtered, held-out and skipped rows; skips logged with their file and row.

    A unit that fails to read (`sources.failure_kind`) is read again from the row it had
    reached while the network fails (RETRIES attempts), is skipped or stops the run if it
    is corrupt (data.on_corrupt_row_group), and otherwise (the network still down, the
    file gone) fails the source: a DataFault naming the source, file and row."""

    def __init__(self, source: Source, units: Sequence[Unit], settings: StreamSettings):
        self.source, self.units, self.settings = source, units, settings
        self.counts: Counter = Counter()

    def documents(self, unit: int = 0, row: int = 0) -> Iterator[tuple]:
        """(document, unit index, row index in the unit, counts before its row) from
        position (unit, row)."""
        for u in range(unit, len(self.units)):
            first = row if u == unit else 0
            for doc, r, before in self._unit_documents(self.units[u], first):
                yield doc, u, r, before

    def _unit_documents(self, unit: Unit, first: int) -> Iterator[tuple[Document, int, dict]]:
        following = [first]  # the next row's index in the unit (_read_unit advances it)
        for attempt in range(1, RETRIES + 1):
            try:
                yield from self._read_unit(unit, following)
                return
            except Exception as err:  # (a generator's close at exit must not evaluate names)
                kind = failure_kind(err)
                if kind == "transport" and attempt < RETRIES:
                    retry_pause(attempt, self._where(unit, following[0]), err)
                    continue
                if kind is None:
                    raise
                if kind == "corrupt":
                    self._corrupt_unit(unit, following[0], err)
                    return
                tries = f" (after {RETRIES} attempts)" if kind == "transport" else ""
                raise DataFault(f"{self._cannot_read(unit, following[0], err)}{tries}") from None

    def _read_unit(self, unit: Unit, following: list[int]) -> Iterator[tuple]:
        counts, where = self.counts, None
        for index, (row, where) in enumerate(self.source.rows(unit, following[0]), following[0]):
            before = dict(counts)
            counts["rows"] += 1
            following[0] = index + 1
            doc = self.source.parser(row)
            if isinstance(doc, Document):
                if self.settings.split and (
                    split_of(doc.id, self.settings.validation_fraction) != self.settings.split
                ):
                    counts["held_out"] += 1
                    continue
                counts["documents"] += 1
                yield doc, index, before
                continue
            counts[doc] += 1
            if doc in SKIP_REASONS:
                self._log_skip(doc, where)
            if counts["rows"] >= STUCK_ROWS and not counts["documents"]:
                raise DataFault(
                    f"{self.source.cfg.uri}: {counts['rows']} rows read without a usable "
                    f"document (last: {where}, {doc})"
                )

    def _where(self, unit: Unit, following: int) -> str:
        """The file and the row a unit's read had reached (`following`: in the unit)."""
        if unit.file < 0:
            return f"the embedded corpus at document {unit.start + following}"
        path, first = self.source.files()[unit.file], unit.start
        if self.source.file_format == "parquet":
            rows = f"rows {first}-{unit.stop - 1}"
            return f"{path} row group {unit.group} ({rows}) at row {first + following}"
        part = f" of its part from byte {first}" if first else ""  # lines: counted from there
        return f"{path} at row {following}{part}"

    def _cannot_read(self, unit: Unit, following: int, err: Exception) -> str:
        reason = " ".join(str(err).split())  # one line: arrow's messages span several
        return f"{self.source.cfg.uri}: cannot read {self._where(unit, following)}: {reason}"

    def _corrupt_unit(self, unit: Unit, following: int, err: Exception) -> None:
        """A unit that cannot be read on (a corrupt parquet page, a broken compressed
        stream): skipped with its unread rows, or the run stops, as configured."""
        message = self._cannot_read(unit, following, err)
        if self.settings.on_corrupt_row_group == "stop":
            raise DataFault(f"{message} (data.on_corrupt_row_group=stop)")
        row = unit.start + following
        lost = unit.stop - row if self.source.file_format == "parquet" else 1
        self.counts["rows"] += lost
        self.counts["corrupt_row_group"] += lost
        log.warning(
            "%s; skipped its %d unread row(s) (data.on_corrupt_row_group=skip)", message, lost
        )

    def _log_skip(self, reason: str, where: str) -> None:
        skipped = sum(self.counts[r] for r in SKIP_REASONS)
        if skipped <= LOGGED_SKIPS or skipped % 1000 == 0:
            log.warning("%s: skipped a row (%s) at %s", self.source.cfg.uri, reason, where)


class SourceStream:
    """One source's windows for one logical reader, epoch after epoch (see the module
    docstring); `windows()` continues from `state` (a Window.state)."""

    def __init__(
        self,
        source: Source,
        units: Sequence[Unit],
        tokenizer: Tokenizer,
        reader: int,
        settings: StreamSettings,
        state: dict | None = None,
    ):
        self.source, self.units, self.tokenizer = source, units, tokenizer
        self.reader, self.settings = reader, settings
        self.state = dict(state or start_state())

    def windows(self, epochs: int | None = None) -> Iterator[Window]:
        """Windows from the state on; `epochs`: stop after that many (None: endless)."""
        epoch, size = self.state["epoch"], self.settings.window
        counts = Counter(self.state["counts"])
        unit, row, skip_tokens = self.state["unit"], self.state["row"], self.state["token"]
        while epochs is None or epoch < epochs:
            share = [self.units[i] for i in self._share(epoch)]
            reader = DocumentReader(self.source, share, self.settings)
            reader.counts = counts
            pending: deque = deque()  # [tokens, unit, row, counts before the row]
            docs = reader.documents(unit, row)
            available, done, yielded = 0, False, False
            while True:
                while available <= size and not done:  # read ahead: is there more?
                    batch = list(itertools.islice(docs, READ_BATCH))
                    done = len(batch) < READ_BATCH
                    available += self._tokenize(batch, pending, skip_tokens)
                    skip_tokens = 0
                if available == 0:
                    break
                take = min(size, available)
                tokens = _take(pending, take)
                available -= take
                counts["tokens"] += take
                last = done and available == 0
                if last:
                    state = _state(epoch + 1, 0, 0, 0, counts)
                else:
                    head = pending[0]
                    state = _state(epoch, head[1], head[2], head[4], head[3])
                    state["counts"]["tokens"] = counts["tokens"]
                yielded = True
                yield Window(tokens, last, state)
                if last:
                    break
            if not yielded:  # an empty share: say so once, as a last (empty) window
                yield Window(np.empty(0, np.int32), True, _state(epoch + 1, 0, 0, 0, counts))
            epoch, unit, row = epoch + 1, 0, 0

    def _share(self, epoch: int) -> list[int]:
        return epoch_shares(self.units, self.settings.readers, self.settings.seed, epoch)[
            self.reader
        ]

    def _tokenize(self, batch: list, pending: deque, skip_tokens: int) -> int:
        """Tokenize documents [(doc, unit, row)] into `pending`; the first drops
        `skip_tokens` (a restored position inside it). Returns the tokens added."""
        if not batch:
            return 0
        ids = self.tokenizer.encode_batch(
            [doc.text for doc, *_ in batch], add_eos=True, num_threads=self.settings.threads
        )
        added = 0
        for i, ((_, unit, row, before), tokens) in enumerate(zip(batch, ids, strict=True)):
            array = np.fromiter(tokens, np.int32, count=len(tokens))  # (faster than asarray)
            offset = skip_tokens if i == 0 else 0
            # the counts before this row: restoring here re-reads (and re-counts) it
            pending.append([array[offset:], unit, row, before, offset])
            added += len(array) - offset
        return added


def _take(pending: deque, n: int) -> np.ndarray:
    """The next n tokens of the pending documents (advancing their offsets)."""
    parts = []
    while n:
        head = pending[0]
        piece = head[0][:n]
        parts.append(piece)
        n -= len(piece)
        if len(piece) == len(head[0]):
            pending.popleft()
        else:
            head[0], head[4] = head[0][len(piece) :], head[4] + len(piece)
    return np.concatenate(parts) if len(parts) != 1 else parts[0]


def _state(epoch: int, unit: int, row: int, token: int, counts) -> dict:
    return {"epoch": epoch, "unit": unit, "row": row, "token": token, "counts": dict(counts)}
