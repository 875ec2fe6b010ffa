"""Streams: the documents of a list of units, tokenized and packed into windows.

A *stream* reads the units of a source it is handed (`data_pipeline/schedule.py` deals
them out), in order: rows -> documents (`RowParser`; corrupt, non-UTF-8 and empty rows
are skipped and counted) -> sentencepiece ids + EOS -> windows of seq_len + 1 tokens. A
document continues from one window into the next, and from one unit's last document into
the next unit's first. The list of units may grow while the stream reads it (the stream
asks for unit k with `unit_at(k)` and is *exhausted* for now when there is none yet);
windows are never held back: a stream that runs out mid-window returns a short one.

Where a stream stands is a `Position`: the unit it reads (its index k in the stream's
list), the row of the document at its head, how many of that document's tokens were
already used, and the tokens and unusable rows of unit k before it. Restoring a position
re-reads that row, tokenizes it and drops the tokens already used, so a stream made at a
position continues with exactly the windows the original would have produced next; any
process holding the position and the list can make one.

Counts (rows, documents, skipped by reason, ...) are attributed to positions, never to
reading ahead: the counts of a stretch of windows are the rows read before the position at
its end minus those before the position at its start, and a unit's own tallies are
reported when the position passes it. So counting is exact however often a stream is
remade, and however far it read ahead.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from data_pipeline.documents import SKIP_REASONS, Document, split_of
from data_pipeline.failures import RETRIES, DataFault, failure_kind, retry_pause
from data_pipeline.reading import Unit
from data_pipeline.sources import Source
from data_pipeline.tokenizer import Tokenizer

log = logging.getLogger(__name__)

READ_BATCH = 32
"""Documents tokenized at a time (one sentencepiece call), at most."""
READ_CHARS_PER_TOKEN = 16
"""A stream stops a batch short of READ_BATCH documents once it holds this many characters
per token of a window (about four windows of English): a run with thousands of streams
must not tokenize far ahead of its first step."""
LOGGED_SKIPS = 10
"""Skipped rows logged one by one per source and process; later ones every 1000th."""
STUCK_ROWS = 10_000
"""A stream that read this many rows without one document stops the run (the fair,
global skip check needs documents to flow); the pre-flight reads as many at most."""
_PHI = (math.sqrt(5) - 1) / 2
SKIPPED = (*SKIP_REASONS, "corrupt_row_group")
"""Counted as unusable rows: what data.max_skipped_fraction limits."""
UNIT_TALLIES = ("units", "unit_rows", "unit_bad", "unit_bad2", "unit_rows2", "unit_rows_bad",
                "unit_tokens", "bad_units")  # fmt: skip
"""Sums over the units a stream finished: their number, rows, unusable rows, the squares
and product of those (the skip check's spread between units), their tokens, and how many
had an unusable row."""


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


class Position(NamedTuple):
    """Where a stream continues."""

    unit: int = 0
    """Index in the stream's list of the unit it reads (the list's length: exhausted)."""
    row: int = 0
    """Row of that unit holding the document at the head (rows before it were read)."""
    token: int = 0
    """Tokens of the head document already in earlier windows."""
    unit_tokens: int = 0
    """Tokens of the unit already in earlier windows."""
    unit_bad: int = 0
    """Unusable rows of the unit before the head."""
    ahead: int = 0
    """In an epoch's tail: the tokens the stream has left, if it read them all ahead
    (> 0), or minus the number it read ahead without reaching its end (< 0); else 0. Not
    needed to continue: it tells the schedule which streams need readers most."""


def epoch_order(units: int, seed: int, epoch: int) -> np.ndarray:
    """The order in which epoch `epoch` deals a source's units out: a seeded permutation."""
    return np.random.default_rng([seed, epoch]).permutation(units)


def slot_source(slot: int, weights: Sequence[float]) -> int:
    """The source of global window slot `slot` of a mixture: the interval of the
    cumulative weights holding frac((slot + 1) x phi) (a Weyl sequence: low discrepancy,
    so any run of slots holds each source's share up to a few windows)."""
    if len(weights) == 1:
        return 0
    total = sum(weights)
    bounds = list(itertools.accumulate(w / total for w in weights))
    return min(bisect.bisect_right(bounds, ((slot + 1) * _PHI) % 1.0), len(weights) - 1)


def slot_sources(slots: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """slot_source of every slot in `slots`, at once."""
    if len(weights) == 1:
        return np.zeros(len(slots), dtype=np.int64)
    bounds = np.cumsum(np.asarray(weights, dtype=np.float64) / sum(weights))
    where = np.searchsorted(bounds, ((slots + 1) * _PHI) % 1.0, side="right")
    return np.minimum(where, len(weights) - 1)


SKIP_CONFIDENCE_Z = 3.0
"""How sure the skip check must be that a source is worse than its limit (standard
deviations of the estimate; 3: about 1 in 700 false stops)."""
MIN_JUDGED_UNITS = 8
"""Finished units before a source is judged mid-epoch: the spread between units needs a few."""


def skip_problem(
    uri: str, counts, max_fraction: float, min_rows: int, whole: bool = False
) -> str | None:
    """Why a source must stop: too many unusable rows, or None.

    A `whole` read (every row of the source, once) compares its exact share. A read in
    progress is judged once `min_rows` rows and MIN_JUDGED_UNITS units were read, and stops
    only when even the lower confidence bound of its unusable share is above the limit.
    Unusable rows come in clusters (one broken file, one bad crawl), so the bound's spread is
    also measured between units (a cluster-robust standard error over the finished units),
    not only assumed binomial between rows: one broken block of a clean corpus leaves the
    bound wide, a source bad throughout narrows it."""
    rows = counts.get("rows", 0)
    skipped = sum(counts.get(reason, 0) for reason in SKIPPED)
    if not rows:
        return None
    share = skipped / rows
    if not whole:
        units = counts.get("units", 0)
        if rows < min_rows or units < MIN_JUDGED_UNITS:
            return None
        binomial = math.sqrt(share * (1 - share) / rows)
        share -= SKIP_CONFIDENCE_Z * max(_cluster_error(counts), binomial)
    if share <= max_fraction:
        return None
    detail = ", ".join(f"{r} {counts[r]}" for r in SKIPPED if counts.get(r))
    spread = ""
    if counts.get("units"):
        spread = f" in {counts.get('bad_units', 0)} of {counts['units']} units read"
    return (
        f"{uri}: {skipped} of {rows} rows unusable ({detail}){spread}, more than "
        f"data.max_skipped_fraction={max_fraction}"
    )


def _cluster_error(counts) -> float:
    """Standard error of the unusable share over the finished units (a ratio estimate,
    each unit one observation of (rows, unusable rows))."""
    n, rows = counts["units"], counts["unit_rows"]
    if n < 2 or not rows:
        return math.inf
    share = counts["unit_bad"] / rows
    spread = (
        counts["unit_bad2"] - 2 * share * counts["unit_rows_bad"] + share**2 * counts["unit_rows2"]
    )
    return math.sqrt(max(spread, 0.0) * n / (n - 1)) / rows


class DocumentReader:
    """The documents of units from a position (unit, row), with counts of rows,
    documents, filtered, held-out and skipped rows; skips logged with their file and row.

    A unit that fails to read (`sources.failure_kind`) is read again from the row it had
    reached while the network fails (RETRIES attempts), is skipped or stops the run if it
    is corrupt (data.on_corrupt_row_group), and otherwise (the network still down, the
    file gone) fails the source: a DataFault naming the source, file and row."""

    _skips_logged: ClassVar[Counter] = Counter()
    """Skipped rows logged so far in this process, per source URI."""

    def __init__(self, source: Source, settings: StreamSettings):
        self.source, self.settings = source, settings
        self.counts: Counter = Counter()
        self.first_bad: str | None = None
        """Where this reader met its first unusable row."""
        self.unit_bad = 0
        """Unusable rows of the unit being read, so far."""

    def documents(self, units: Sequence[Unit], unit: int = 0, row: int = 0) -> Iterator[tuple]:
        """(document, unit index, row index in the unit, counts before its row) from
        position (unit, row) of `units`."""
        for u in range(unit, len(units)):
            for doc, r, before in self.unit_documents(units[u], row if u == unit else 0):
                yield doc, u, r, before

    def unit_documents(
        self, unit: Unit, first: int = 0, bad: int = 0
    ) -> Iterator[tuple[Document, int, dict]]:
        """(document, row index in the unit, counts before its row) from row `first`;
        `bad`: the unit's unusable rows before it (unit_bad counts on from there)."""
        self.unit_bad = bad
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
                self._skipped(doc, where)
            if counts["rows"] >= STUCK_ROWS and not (counts["documents"] or counts["held_out"]):
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
        self.unit_bad += lost
        self.first_bad = self.first_bad or self._where(unit, following)
        log.warning(
            "%s; skipped its %d unread row(s) (data.on_corrupt_row_group=skip)", message, lost
        )

    def _skipped(self, reason: str, where: str) -> None:
        self.unit_bad += 1
        self.first_bad = self.first_bad or where
        logged = self._skips_logged
        logged[self.source.cfg.uri] += 1
        if logged[self.source.cfg.uri] <= LOGGED_SKIPS or logged[self.source.cfg.uri] % 1000 == 0:
            log.warning("%s: skipped a row (%s) at %s", self.source.cfg.uri, reason, where)


@dataclass
class _Pending:
    """A tokenized document not yet wholly in windows."""

    tokens: np.ndarray
    unit: int
    row: int
    offset: int
    """Tokens of the document already taken (its first token in `tokens` is this one)."""
    before: dict
    """The reader's counts before its row."""
    unit_bad: int
    """Unusable rows of its unit before its row."""


class SourceStream:
    """The windows of one stream of a source (see the module docstring): `next_window()`
    until it returns None (exhausted for now; it continues if the list grows)."""

    def __init__(
        self,
        source: Source,
        units: Sequence[Unit],
        tokenizer: Tokenizer,
        settings: StreamSettings,
        position: Position,
        unit_at: Callable[[int], int | None],
    ):
        self.source, self.units, self.tokenizer = source, units, tokenizer
        self.settings, self.unit_at = settings, unit_at
        self.reader = DocumentReader(source, settings)
        self.pending: deque[_Pending] = deque()
        self.available = 0
        self.reading, self.next_row = position.unit, position.row  # where reading continues
        self.skip_tokens = position.token  # of the first document read
        self.documents: Iterator | None = None
        # per unit from the position on: [rows read, unusable rows read, tokens taken]
        self.tallies = {position.unit: [position.row, position.unit_bad, position.unit_tokens]}
        self.tokens_taken = 0

    def next_window(self) -> np.ndarray | None:
        """The next window (int32; short only where the stream ran out), or None when it
        has nothing now."""
        size = self.settings.window
        while self.available <= size and self._read():
            pass
        if not self.available:
            return None
        take = min(size, self.available)
        self.available -= take
        self.tokens_taken += take
        parts = []
        while take:
            head = self.pending[0]
            piece = head.tokens[:take]
            parts.append(piece)
            take -= len(piece)
            self.tallies[head.unit][2] += len(piece)
            if len(piece) == len(head.tokens):
                self.pending.popleft()
            else:
                head.tokens, head.offset = head.tokens[len(piece) :], head.offset + len(piece)
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    @property
    def first_bad(self) -> str | None:
        """Where this stream met its first unusable row."""
        return self.reader.first_bad

    def position(self) -> Position:
        """Where the next window starts (after reading ahead, so it knows whether the
        stream is exhausted)."""
        if not self.pending:
            return Position(self.reading)
        head = self.pending[0]
        return Position(head.unit, head.row, head.offset, self.tallies[head.unit][2], head.unit_bad)

    def look_ahead(self, tokens: int) -> int:
        """Position.ahead: read on until more than `tokens` tokens are pending or the list
        is read (the result depends on the data alone, not on how far it had read)."""
        while self.available <= tokens and self._read():
            pass
        return self.available if self.available <= tokens else -tokens

    def counts(self) -> Counter:
        """Counts of the rows before the position (since this stream was made), plus the
        tokens taken."""
        counts = Counter(self.pending[0].before if self.pending else self.reader.counts)
        counts["tokens"] = self.tokens_taken
        return counts

    def finished_units(self, before: int) -> Counter:
        """UNIT_TALLIES over the units before index `before` (the position passed them),
        which are then forgotten."""
        out = Counter()
        for k in [k for k in self.tallies if k < before]:
            rows, bad, tokens = self.tallies.pop(k)
            out.update(
                units=1, unit_rows=rows, unit_bad=bad, unit_bad2=bad * bad, unit_rows2=rows * rows,
                unit_rows_bad=rows * bad, unit_tokens=tokens, bad_units=int(bad > 0),
            )  # fmt: skip
        return out

    def _read(self) -> bool:
        """Read and tokenize up to READ_BATCH more documents; False if there were none."""
        batch, chars = [], 0
        while len(batch) < READ_BATCH and chars < READ_CHARS_PER_TOKEN * self.settings.window:
            if self.documents is None:
                unit = self.unit_at(self.reading)
                if unit is None:
                    break
                self.tallies.setdefault(self.reading, [0, 0, 0])
                self.documents = self._unit_documents(self.units[unit], self.next_row)
            item = next(self.documents, None)
            if item is None:
                self.documents, self.reading, self.next_row = None, self.reading + 1, 0
                continue
            batch.append(item)
            chars += len(item[0].text)
        if not batch:
            return False
        ids = self.tokenizer.encode_batch(
            [doc.text for doc, *_ in batch], add_eos=True, num_threads=self.settings.threads
        )
        for (_, unit, row, before, bad), tokens in zip(batch, ids, strict=True):
            array = np.fromiter(tokens, np.int32, count=len(tokens))  # (faster than asarray)
            offset, self.skip_tokens = self.skip_tokens, 0
            self.pending.append(_Pending(array[offset:], unit, row, offset, before, bad))
            self.available += len(array) - offset
        return True

    def _unit_documents(self, unit: Unit, first: int) -> Iterator[tuple]:
        """The unit's documents with what a pending document records, keeping its tallies."""
        tally, reading = self.tallies[self.reading], self.reading
        rows_before = self.reader.counts["rows"]
        for doc, row, before in self.reader.unit_documents(unit, first, tally[1]):
            tally[0] += self.reader.counts["rows"] - rows_before
            tally[1] = self.reader.unit_bad
            rows_before = self.reader.counts["rows"]
            yield doc, reading, row, before, self.reader.unit_bad
        tally[0] += self.reader.counts["rows"] - rows_before
        tally[1] = self.reader.unit_bad


def stream_for(
    source,
    units: Sequence[Unit],
    tokenizer: Tokenizer,
    settings: StreamSettings,
    position: Position,
    unit_at: Callable[[int], int | None],
):
    """A stream of `source`'s `units` from `position`, the k-th of its list being
    units[unit_at(k)] (prepared data has its own kind of stream)."""
    if not isinstance(source, Source):
        return source.stream(units, settings, position, unit_at)
    return SourceStream(source, units, tokenizer, settings, position, unit_at)
