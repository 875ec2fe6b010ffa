"""Streams: the documents of a list of units, tokenized and drawn into windows.

A *stream* reads the units of a source it is handed (`data_pipeline/schedule.py` deals
them out), in order: rows -> documents (`RowParser`; corrupt, non-UTF-8 and empty rows
are skipped and counted) -> sentencepiece ids + EOS. It keeps `lanes` documents open at
once and takes each window (seq_len + 1 tokens) from one of them, chosen by a seeded draw
(a function of the seed, the source, the stream and the window's number: the
same in every process and at every layout), never the lane of its previous window while
another one has tokens. A lane whose document ends mid-window opens the next document,
read where the stream's *cursor* stands; once no document is left to open the lanes are
drawn in proportion to the tokens they hold, so that they end together. So a stream's
consecutive windows come from different documents, a long document is interleaved with
the others, and the windows of a document are spread over many steps, as when samples are
shuffled. With one lane a stream packs its documents one after another. The list of units
may grow while the stream reads it (the stream asks for unit k with `unit_at(k)` and is
*exhausted* for now when there is none yet and its lanes are empty); windows are never held
back: a stream that runs out mid-window returns a short one.

Where a stream stands is a `Position`: the cursor (the unit and row of the next document
to open, with the tokens and unusable rows of that unit before it), the windows drawn so
far and the last lane drawn, and per lane the unit, row and tokens taken of its open
document. Restoring a position re-reads the rows from the earliest open document to the
cursor, tokenizes only the open documents and drops the tokens already taken, so a stream
made at a position continues with exactly the windows the original would have produced
next; any process holding the position and the list can make one.

Counts (rows, documents, skipped by reason, ...) are attributed to the cursor, never to
reading ahead: the counts of a stretch of windows are the rows read before the cursor at
its end minus those before the cursor at its start, and a unit's own tallies (its rows,
unusable rows, and the tokens of its documents, counted when each is opened) are reported
when the cursor passes it. So counting is exact however often a stream is remade, and
however far it read ahead.
"""

from __future__ import annotations

import bisect
import hashlib
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
    lanes: int = 1
    """Documents a stream keeps open, drawing each window from one of them (1: one
    document after another)."""


class Position(NamedTuple):
    """Where a stream continues (see the module docstring); in a report or a saved state,
    the integers of `pack`."""

    unit: int = 0
    """The cursor: index in the stream's list of the unit holding the next document to
    open (the list's length: none is left to open for now)."""
    row: int = 0
    """Row of that unit holding the next document to open (rows before it were read)."""
    unit_tokens: int = 0
    """Tokens of that unit's documents opened so far."""
    unit_bad: int = 0
    """Unusable rows of that unit before the row."""
    open: int = 0
    """Tokens left in the open documents (-1: a state of format 2 converted, whose open
    document's tokens left are not yet in its unit's tally)."""
    drawn: int = 0
    """Windows the stream has produced: the number of the next window's draw."""
    last: int = -1
    """The lane of the last window (-1: none yet)."""
    lanes: tuple[tuple[int, int, int], ...] = ()
    """Per lane holding an open document: (lane, unit, row, taken), the unit and row of
    the document and its tokens already taken."""

    def pack(self, lanes: int) -> list[int]:
        """The position as `position_fields(lanes)` integers (a lane without a document:
        unit -1)."""
        slots = [[-1, 0, 0] for _ in range(lanes)]
        for lane, unit, row, taken in self.lanes:
            slots[lane] = [unit, row, taken]
        return [*self[:SCALARS], *(x for slot in slots for x in slot)]

    @classmethod
    def unpack(cls, values: Sequence[int]) -> Position:
        """The position `pack` wrote."""
        values = [int(v) for v in values]
        rest = values[SCALARS:]
        lanes = tuple(
            (lane, *rest[3 * lane : 3 * lane + 3])
            for lane in range(len(rest) // 3)
            if rest[3 * lane] >= 0
        )
        return cls(*values[:SCALARS], lanes=lanes)


SCALARS = len(Position._fields) - 1
"""Integers of a Position before its lanes'."""
UNIT = Position._fields.index("unit")
"""The column of a packed Position that holds the cursor's unit."""
LANE_UNITS = slice(SCALARS, None, 3)
"""Columns of a packed Position holding each lane's unit (-1: no document)."""


def position_fields(lanes: int) -> int:
    """Integers of a packed Position of a stream with `lanes` lanes."""
    return SCALARS + 3 * lanes


def draw(key: Sequence[int], n: int) -> float:
    """A uniform number in [0, 1) for draw `n` of the stream `key` (seed, source, stream):
    a hash, so any process computes it without the draws before it."""
    digest = hashlib.blake2b(np.array([*key, n], dtype=np.int64).tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") / 2.0**64


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

    def __init__(self, source: Source, settings: StreamSettings, quiet: bool = False):
        self.source, self.settings, self.quiet = source, settings, quiet
        """quiet: rows read again (a stream remade), whose skips were logged already."""
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
        if not self.quiet:
            log.warning(
                "%s; skipped its %d unread row(s) (data.on_corrupt_row_group=skip)", message, lost
            )

    def _skipped(self, reason: str, where: str) -> None:
        self.unit_bad += 1
        self.first_bad = self.first_bad or where
        if self.quiet:
            return
        logged = self._skips_logged
        logged[self.source.cfg.uri] += 1
        if logged[self.source.cfg.uri] <= LOGGED_SKIPS or logged[self.source.cfg.uri] % 1000 == 0:
            log.warning("%s: skipped a row (%s) at %s", self.source.cfg.uri, reason, where)


@dataclass
class _Pending:
    """A tokenized document at the cursor, not yet opened."""

    tokens: np.ndarray
    unit: int
    row: int
    before: dict
    """The reader's counts before its row."""
    unit_bad: int
    """Unusable rows of its unit before its row."""


@dataclass
class _Open:
    """A document open in a lane: the tokens not yet taken."""

    tokens: np.ndarray
    unit: int
    row: int
    taken: int
    """Tokens of the document already taken (its first token in `tokens` is this one)."""


class SourceStream:
    """The windows of one stream of a source (see the module docstring): `next_window()`
    until it returns None (exhausted for now; it continues if the list grows); `pieces`
    says where the last window's tokens came from."""

    def __init__(
        self,
        source: Source,
        units: Sequence[Unit],
        tokenizer: Tokenizer,
        settings: StreamSettings,
        position: Position,
        unit_at: Callable[[int], int | None],
        key: Sequence[int] = (),
    ):
        self.source, self.units, self.tokenizer = source, units, tokenizer
        self.settings, self.unit_at, self.key = settings, unit_at, tuple(key)
        self.reader = DocumentReader(source, settings)
        self.pending: deque[_Pending] = deque()
        self.pending_tokens = 0
        self.lanes: list[_Open | None] = [None] * settings.lanes
        self.open_tokens = 0
        self.drawn, self.last = position.drawn, position.last
        self.reading, self.next_row = position.unit, position.row  # where reading continues
        self.documents: Iterator | None = None
        # per unit from the cursor on: [rows read, unusable rows read, tokens opened]
        self.tallies = {position.unit: [position.row, position.unit_bad, position.unit_tokens]}
        self.tokens_taken = 0
        self.pieces: list[tuple[tuple[int, int], int, int]] = []
        """The last window's pieces: ((unit, row) of a document, first token, tokens)."""
        if position.lanes:
            self._reopen(position)

    def next_window(self) -> np.ndarray | None:
        """The next window (int32; short only where the stream ran out), or None when it
        has nothing now."""
        if not self.open_tokens and not self._can_open():
            return None
        lane = self._draw()
        self.drawn, self.last = self.drawn + 1, lane
        parts, self.pieces, need = [], [], self.settings.window
        while need:
            doc = self.lanes[lane]
            if doc is None:
                if self._can_open():
                    doc = self.lanes[lane] = self._open()
                else:  # nothing left to open: the window goes on with the next lane
                    lane = self._next_open_lane(lane)
                    if lane is None:
                        break
                    continue
            piece = doc.tokens[:need]
            parts.append(piece)
            self.pieces.append(((doc.unit, doc.row), doc.taken, len(piece)))
            need -= len(piece)
            doc.tokens, doc.taken = doc.tokens[len(piece) :], doc.taken + len(piece)
            self.open_tokens -= len(piece)
            if not len(doc.tokens):
                self.lanes[lane] = None
        taken = self.settings.window - need
        self.tokens_taken += taken
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def _draw(self) -> int:
        """The lane of the next window: uniform over the lanes other than the last one
        while documents are left to open, else over those holding tokens in proportion to
        them (so that they end together)."""
        lanes = len(self.lanes)
        if lanes == 1:
            return 0
        u = draw(self.key, self.drawn)
        if self._can_open():
            candidates = [j for j in range(lanes) if j != self.last]
            return candidates[int(u * len(candidates))]
        holding = [j for j in range(lanes) if self.lanes[j] is not None]
        candidates = [j for j in holding if j != self.last] or holding
        weights = np.cumsum([len(self.lanes[j].tokens) for j in candidates])
        return candidates[int(np.searchsorted(weights, u * weights[-1], side="right"))]

    def _next_open_lane(self, lane: int) -> int | None:
        """The first lane after `lane` (cyclically) holding tokens, or None."""
        lanes = len(self.lanes)
        for j in range(lane + 1, lane + 1 + lanes):
            if self.lanes[j % lanes] is not None:
                return j % lanes
        return None

    def _can_open(self) -> bool:
        """Whether a document is left to open now (reading ahead to know it)."""
        return bool(self.pending) or self._read()

    def _open(self) -> _Open:
        """Open the document at the cursor; its tokens count to its unit."""
        doc = self.pending.popleft()
        self.pending_tokens -= len(doc.tokens)
        self.open_tokens += len(doc.tokens)
        self.tallies[doc.unit][2] += len(doc.tokens)
        return _Open(doc.tokens, doc.unit, doc.row, 0)

    @property
    def first_bad(self) -> str | None:
        """Where this stream met its first unusable row."""
        return self.reader.first_bad

    def position(self) -> Position:
        """Where the stream stands (after reading ahead, so it knows whether it is
        exhausted)."""
        self._can_open()
        lanes = tuple(
            (lane, doc.unit, doc.row, doc.taken)
            for lane, doc in enumerate(self.lanes)
            if doc is not None
        )
        state = {"open": self.open_tokens, "drawn": self.drawn, "last": self.last, "lanes": lanes}
        if not self.pending:
            return Position(self.reading, **state)
        head = self.pending[0]
        return Position(head.unit, head.row, self.tallies[head.unit][2], head.unit_bad, **state)

    def counts(self) -> Counter:
        """Counts of the rows before the cursor (since this stream was made), plus the
        tokens taken."""
        counts = Counter(self.pending[0].before if self.pending else self.reader.counts)
        counts["tokens"] = self.tokens_taken
        return counts

    def finished_units(self, before: int) -> Counter:
        """UNIT_TALLIES over the units before index `before` (the cursor passed them),
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
        ids = self._encode([doc.text for doc, *_ in batch])
        for (_, unit, row, before, bad), tokens in zip(batch, ids, strict=True):
            self.pending.append(_Pending(tokens, unit, row, before, bad))
            self.pending_tokens += len(tokens)
        return True

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tokenizer.encode_batch(texts, add_eos=True, num_threads=self.settings.threads)
        return [np.fromiter(t, np.int32, count=len(t)) for t in ids]  # (faster than asarray)

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

    def _reopen(self, position: Position) -> None:
        """The lanes' documents at `position`: the rows from the earliest to the cursor read
        again (quietly: their counts and skips belong to the stream that read them first),
        only the open documents tokenized, the tokens already taken dropped."""
        wanted = {(unit, row): (lane, taken) for lane, unit, row, taken in position.lanes}
        reader = DocumentReader(self.source, self.settings, quiet=True)
        first_unit, first_row = min(wanted)
        found = []
        for k in range(first_unit, position.unit + 1):  # (they are before the cursor)
            index = None if len(found) == len(wanted) else self.unit_at(k)
            if index is None:
                break
            start = first_row if k == first_unit else 0
            for doc, row, _ in reader.unit_documents(self.units[index], start):
                if (k, row) in wanted:
                    found.append(((k, row), doc.text))
                    if len(found) == len(wanted):
                        break
        if len(found) != len(wanted):
            raise RuntimeError(
                f"{self.source.cfg.uri}: the open documents of a saved position were not "
                "found again (the data changed?)"
            )
        encoded = self._encode([text for _, text in found])
        for ((unit, row), _), tokens in zip(found, encoded, strict=True):
            lane, taken = wanted[(unit, row)]
            self.lanes[lane] = _Open(tokens[taken:], unit, row, taken)
            self.open_tokens += len(tokens) - taken
        if position.open < 0:  # (see Position.open)
            self.tallies[position.unit][2] += self.open_tokens


def stream_for(
    source,
    units: Sequence[Unit],
    tokenizer: Tokenizer,
    settings: StreamSettings,
    position: Position,
    unit_at: Callable[[int], int | None],
    key: Sequence[int] = (),
):
    """A stream of `source`'s `units` from `position`, the k-th of its list being
    units[unit_at(k)], its draws keyed by `key` (seed, source, stream). Prepared
    data has its own kind of stream (its samples are shuffled already)."""
    if not isinstance(source, Source):
        return source.stream(units, settings, position, unit_at)
    return SourceStream(source, units, tokenizer, settings, position, unit_at, key)
