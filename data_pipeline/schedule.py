"""The schedule: which units each stream reads and which stream each reader serves.

A run has R logical readers; every step, reader r fills its slots of each source from a
stream (`stream.SourceStream`). Reader r starts each epoch on stream r of its own, and the
schedule deals out the source's units to the streams as they need them: the epoch's units
wait in a seeded order (the *queue*), and after every step each stream whose estimated
work falls below TARGET_STEPS steps is handed the next ones. So readers never wait for a
slow share: whichever stream runs low takes the next unit, and every unit of the epoch is
read by exactly one stream before any is read again.

When the queue is empty the epoch is in its *tail*: streams run out one by one. A reader
whose stream has run out then joins a stream that still has work (from JOIN_DELAY steps
after the queue emptied; the nearest such stream by reader index, and among those the one
with the most work per reader): the readers of a stream share its windows, step by step,
in reader order. Streams read their ends ahead in the tail, so that from then on each
takes exactly as many readers as it has windows left. The tail thus ends within a step of
the same time for every reader, whatever the documents' lengths: padding is each stream's
last, short window and the epoch's last step. When every stream of a source has run out,
its next epoch begins at the following step, for every reader alike.

A stream's position is its cursor (the unit it reads, where its next document to open
is) with the tokens of the documents it holds open (`stream.Position`): the units before
the cursor are passed, and a stream is exhausted when its cursor is at its list's end and
its documents are used up.

The schedule changes only at `commit`, once per step, from what the step's streams report
(their positions after it, and the tallies of the units they finished) summed over the
ranks: every rank and every loader worker holds a replica and applies the same reports, so
all of them agree on every decision, and the decisions depend on the data and the step
alone, never on the number of ranks or workers. The whole state is a few integers per
reader and per unit: a checkpoint holds it once, valid at any layout.

Estimates are tokens: a unit's size (bytes or characters of text, samples of prepared
data) times the source's tokens per size, measured on the units finished so far.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from data_pipeline.stream import (
    AHEAD,
    LANE_UNITS,
    OPEN,
    UNIT,
    UNIT_TOKENS,
    Position,
    epoch_order,
    position_fields,
    slot_sources,
)

UNITS_PER_READER = 8
"""Sources are cut into units of at most 1/(readers x this) of their size: enough units for
every stream to start on its own, and small enough that a tail stays short. Not finer:
pieces of one parquet row group each decode the rows before them."""
TAIL_LOOK_AHEAD = 8
"""In an epoch's tail, streams read this many steps of their readers' windows ahead, so
that where one ends is known, not estimated, when readers choose a stream to join."""
TARGET_STEPS = 4
"""Steps of estimated work a stream is kept supplied with (beyond what it reads in the
steps a loader worker runs ahead)."""
PRIOR_SHARE = 1 / 8
"""The first guess of tokens per size weighs as much as this share of a source, measured."""
JOIN_DELAY = 2
"""Steps after the queue emptied before readers join other streams: a loader worker may
then produce the next step before it has the last step's reports (see `view_needed`)."""


@dataclass
class SourceDeal:
    """One source's epoch: its units' order, the queue, every stream's list and position,
    and which stream every reader serves."""

    sizes: np.ndarray
    """Size of each unit (Unit.size)."""
    tokens_per_size: float
    """The first guess of tokens per size, until units are finished."""
    tokens_per_step: float
    """Tokens one reader takes from this source in a step, on average."""
    readers: int
    seed: int
    lanes: int = 1
    """Documents each stream keeps open (the width of its packed Position)."""
    epoch: int = 0
    handed: int = 0
    """Units of the epoch's order dealt out so far."""
    emptied: int | None = None
    """The step whose commit emptied the queue (None: not yet this epoch)."""
    lists: list[list[int]] = field(default_factory=list)
    """Per stream, the units it was handed this epoch, in order."""
    positions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    """Per stream, its packed Position (int64 [readers, position_fields(lanes)])."""
    follow: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Per reader, the stream it serves."""
    finished_size: int = 0
    finished_tokens: int = 0
    """Sizes and tokens of the units finished so far (every epoch): the measured ratio."""
    finished_rows: int = 0
    """Rows of the units finished so far: with their tokens, the tokens of a document."""

    def __post_init__(self) -> None:
        self.total = int(self.sizes.sum())
        self.order = np.zeros(0, np.int64)
        # per stream (kept with lists and positions): units handed, their total size, the
        # size of those before the position, and that of the unit at it (0: exhausted)
        self.lengths = self.listed = self.passed = self.head = np.zeros(0, np.int64)

    def begin(self, epoch: int, step: int) -> None:
        """Start epoch `epoch` at the commit of step `step` (a fresh order, empty streams,
        each reader on its own), and deal the first units."""
        self.epoch, self.handed, self.emptied = epoch, 0, None
        self.order = epoch_order(len(self.sizes), self.seed, epoch)
        self.lists = [[] for _ in range(self.readers)]
        self.positions = np.tile(np.array(Position().pack(self.lanes)), (self.readers, 1))
        self.follow = np.arange(self.readers)
        self._index()
        self.hand_out(step)

    def _index(self) -> None:
        """The per-stream sums, from the lists and positions."""
        self.lengths = np.array([len(units) for units in self.lists], dtype=np.int64)
        self.listed = np.array([self.sizes[units].sum() for units in self.lists], dtype=np.int64)
        at = self.positions[:, UNIT]
        pairs = list(zip(self.lists, at, strict=True))
        self.passed = np.array([self.sizes[units[:k]].sum() for units, k in pairs], np.int64)
        self.head = np.array([self.sizes[units[k]] if k < len(units) else 0 for units, k in pairs],
                             np.int64)  # fmt: skip

    @property
    def ratio(self) -> float:
        """Tokens per size: measured on the finished units, with the first guess counted as
        if PRIOR_SHARE of the source had been read at it. The units that finish first are
        no fair sample (those with a held-out giant or an unusable row, the short ones), and
        on their own they made every unit look nearly empty: the whole queue was handed out
        in the first steps, and the epoch was one long tail."""
        prior = PRIOR_SHARE * self.total
        return (self.finished_tokens + self.tokens_per_size * prior) / (self.finished_size + prior)

    def document_tokens(self) -> float:
        """Tokens of a document (a row) on average, the work a lane without a document
        waits for: measured on the finished units, with a first guess of a step's tokens
        counted as if every lane of every stream had held a document of it (the units
        that finish first are no fair sample: one holding a single long document made
        every stream wait for dozens of units)."""
        prior = self.readers * self.lanes
        tokens = self.finished_tokens + prior * self.tokens_per_step
        return tokens / (self.finished_rows + prior)

    def exhausted(self) -> np.ndarray:
        """Per stream: read all it was handed, and used up its open documents."""
        return (self.positions[:, UNIT] >= self.lengths) & (self.positions[:, OPEN] == 0)

    def queued(self) -> np.ndarray:
        """Per stream, the estimated tokens of the units it was handed and has not begun."""
        return (self.listed - self.passed - self.head) * self.ratio

    def remaining(self) -> np.ndarray:
        """Per stream, its tokens still to read: known where it read them all ahead, else
        estimated (its open documents' tokens are known), and at least what it read ahead
        (at least 1 unless exhausted)."""
        current = np.maximum(self.head * self.ratio - self.positions[:, UNIT_TOKENS], 1)
        current = current + self.positions[:, OPEN]
        ahead = self.positions[:, AHEAD]
        estimate = np.maximum(self.queued() + current, -ahead)
        return np.where(self.exhausted(), 0.0, np.where(ahead > 0, ahead, estimate))

    def look_ahead(self, step_tokens: float, members: int) -> int:
        """Tokens a stream with `members` readers reads ahead in the tail (else 0)."""
        if self.handed < len(self.order):
            return 0
        return int(TAIL_LOOK_AHEAD * step_tokens * members)

    def hand_out(self, step: int) -> None:
        """Deal queued units, one per needy stream per round in stream order, to every
        stream with less than TARGET_STEPS steps of estimated work for its readers beyond
        the unit it reads (whose end an estimate cannot foresee: a stream runs dry only if
        the units it was handed hold far less than their sizes promise), plus a document's
        for each of its lanes without one (so that it has documents to open them with: a
        stream with one document open and none to open draws its windows from it)."""
        if self.handed == len(self.order):
            return
        members = np.bincount(self.follow, minlength=self.readers)
        empty = self.lanes - (self.positions[:, LANE_UNITS] >= 0).sum(axis=1)
        need = TARGET_STEPS * members * self.tokens_per_step + empty * self.document_tokens()
        remaining = self.queued()
        needy = np.nonzero(remaining < need)[0]
        while len(needy) and self.handed < len(self.order):
            for h in needy[: len(self.order) - self.handed]:
                unit = int(self.order[self.handed])
                self.handed += 1
                size = self.sizes[unit]
                if self.positions[h, UNIT] == self.lengths[h]:  # it waited at its list's end
                    self.head[h] = size
                self.lists[h].append(unit)
                self.lengths[h] += 1
                self.listed[h] += size
                remaining[h] += size * self.ratio
            needy = needy[remaining[needy] < need[needy]]
        if self.handed == len(self.order):
            self.emptied = step

    def join(self, slots: np.ndarray, window: int) -> None:
        """Readers choose streams for the next step, in which reader r has `slots[r]`
        windows of this source. A stream keeps its readers, in reader order, while it has
        windows left for them (known exactly once it read its end ahead); the others, and
        those whose stream ran out, join the streams with windows to spare, the most
        estimated work per reader first. So once every stream's end is known, each step
        is filled until the epoch's last."""
        exhausted = self.exhausted()
        remaining = self.remaining()
        ahead = self.positions[:, AHEAD]
        capacity = np.where(ahead > 0, -(-ahead // window), np.iinfo(np.int64).max)
        used = np.zeros(self.readers, dtype=np.int64)
        members = np.zeros(self.readers, dtype=np.int64)
        free = []
        for reader, h in enumerate(self.follow.tolist()):
            if exhausted[h] or used[h] >= capacity[h]:
                free.append(reader)
            else:
                used[h] += slots[reader]
                members[h] += 1
        for reader in free:
            spare = ~exhausted & (used < capacity)
            if not spare.any():
                self.follow[reader] = reader  # nothing to read: its slots are padding
                continue
            # the nearest streams first (sharing the longest prefix of reader indices: a
            # layout's rank or worker holds a contiguous block of readers, so a stream whose
            # readers are near each other is read by few processes), then the most work
            candidates = np.nonzero(spare)[0]
            level = np.floor(np.log2(np.bitwise_xor(candidates, reader) + 1))
            candidates = candidates[level == level.min()]
            h = candidates[np.argmax(remaining[candidates] / (members[candidates] + 1))]
            self.follow[reader] = h
            used[h] += slots[reader]
            members[h] += 1

    def commit(
        self,
        reported: np.ndarray,
        positions: np.ndarray,
        tokens: int,
        step: int,
        slots: np.ndarray,
        window: int,
        rows: int = 0,
    ) -> bool:
        """Apply the reports of step `step` (positions of the streams `reported`, tokens and
        rows of the units finished; `slots`: each reader's windows of this source in the
        next step, of `window` tokens); True if the next epoch begins."""
        for h in np.nonzero(reported & (positions[:, UNIT] != self.positions[:, UNIT]))[0]:
            units, old, new = self.lists[h], self.positions[h, UNIT], positions[h, UNIT]
            passed = int(self.sizes[units[old:new]].sum())
            self.finished_size += passed
            self.passed[h] += passed
            self.head[h] = self.sizes[units[new]] if new < len(units) else 0
        self.finished_tokens += tokens
        self.finished_rows += rows
        self.positions[reported] = positions[reported]
        if self.handed == len(self.order) and self.exhausted().all():
            self.begin(self.epoch + 1, step)
            return True
        if self.handed < len(self.order):
            self.hand_out(step)
        elif step >= self.emptied + JOIN_DELAY - 1:
            self.join(slots, window)
        return False

    def groups(self, readers: Sequence[int]) -> dict[int, np.ndarray]:
        """The streams `readers` serve, each with all its readers (sorted)."""
        streams = sorted(set(self.follow[list(readers)].tolist()))
        if (self.follow == np.arange(self.readers)).all():  # no reader joined another
            return {h: np.array([h]) for h in streams}
        by_stream = np.argsort(self.follow, kind="stable")
        ordered = self.follow[by_stream]
        starts = np.searchsorted(ordered, streams, side="left")
        ends = np.searchsorted(ordered, streams, side="right")
        return {h: by_stream[a:b] for h, a, b in zip(streams, starts, ends, strict=True)}

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch, "handed": self.handed, "emptied": self.emptied,
            "units": np.array([u for units in self.lists for u in units], dtype=np.int64),
            "lengths": self.lengths.copy(), "positions": self.positions.copy(),
            "follow": self.follow.copy(), "finished_size": self.finished_size,
            "finished_tokens": self.finished_tokens, "finished_rows": self.finished_rows,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.handed, self.emptied = state["epoch"], state["handed"], state["emptied"]
        self.order = epoch_order(len(self.sizes), self.seed, self.epoch)
        bounds = np.cumsum([0, *state["lengths"]]).tolist()
        units = state["units"].tolist()
        self.lists = [units[a:b] for a, b in itertools.pairwise(bounds)]
        self.positions = np.array(state["positions"], dtype=np.int64)
        self.follow = np.array(state["follow"], dtype=np.int64)
        self.finished_size, self.finished_tokens = state["finished_size"], state["finished_tokens"]
        self.finished_rows = state.get("finished_rows", 0)  # (format 2: not counted)
        self._index()


class Schedule:
    """Every source's deal, committed step by step (see the module docstring)."""

    def __init__(
        self,
        sizes: Sequence[Sequence[int]],
        tokens_per_size: Sequence[float],
        weights: Sequence[float],
        readers: int,
        per_reader: int,
        window: int,
        seed: int,
        lanes: int = 1,
    ):
        self.step = 0
        """Steps committed: this is the schedule of step `step`."""
        self.weights, self.per_reader, self.window = list(weights), per_reader, window
        self.fields = position_fields(lanes)
        """Integers of a stream's packed Position."""
        total = sum(weights)
        self.deals = [
            SourceDeal(np.asarray(size, dtype=np.int64), ratio, per_reader * window * w / total,
                       readers, seed, lanes)
            for size, ratio, w in zip(sizes, tokens_per_size, weights, strict=True)
        ]  # fmt: skip
        for deal in self.deals:
            deal.begin(0, -1)

    def slots(self, step: int) -> np.ndarray:
        """Windows of each source [sources, readers] each reader fills in step `step`."""
        first = step * self.readers * self.per_reader
        slots = np.arange(first, first + self.readers * self.per_reader)
        sources = slot_sources(slots, self.weights).reshape(self.readers, self.per_reader)
        return np.stack([(sources == s).sum(axis=1) for s in range(len(self.deals))])

    @property
    def readers(self) -> int:
        return self.deals[0].readers

    def report_size(self) -> int:
        """Integers per source in a step's report (the positions of all streams)."""
        return self.readers * (1 + self.fields)

    def commit(
        self,
        reports: Sequence[np.ndarray],
        tokens: Sequence[int],
        rows: Sequence[int] | None = None,
    ) -> list[bool]:
        """Apply one step's summed reports (per source: [readers, 1 + fields], a stream's
        row [1, *position] where a stream reported), and the tokens and rows of the units
        finished; per source, whether its next epoch begins."""
        turned, slots = [], self.slots(self.step + 1)
        rows = rows if rows is not None else [0] * len(self.deals)
        for deal, report, finished, counts, read in zip(
            self.deals, reports, tokens, slots, rows, strict=True
        ):
            report = np.asarray(report).reshape(self.readers, 1 + self.fields)
            reported, positions = report[:, 0] > 0, report[:, 1:]
            turned.append(
                deal.commit(reported, positions, int(finished), self.step, counts, self.window,
                            int(read))
            )  # fmt: skip
        self.step += 1
        return turned

    def in_tail(self) -> bool:
        """Whether any source's queue is empty (readers may join other streams, or an
        epoch begin, at any commit)."""
        return any(deal.handed == len(deal.order) for deal in self.deals)

    def view_needed(self, step: int) -> int:
        """The schedule a loader worker must have applied before producing step `step`.

        Outside the tail, one step behind suffices: readers join other streams only
        JOIN_DELAY commits after the queue emptied, and an epoch begins at the earliest one
        commit after (the units dealt at that commit are read in the following step), so
        nothing but the lists' growth can change between the schedule of step - 1 and that
        of `step` (and a stream that reaches the end of its list waits for the schedule of
        `step` before it calls itself exhausted). In the tail, exactly `step`."""
        return step if self.in_tail() else step - 1

    def state_dict(self) -> dict:
        return {"step": self.step, "sources": [deal.state_dict() for deal in self.deals]}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for deal, saved in zip(self.deals, state["sources"], strict=True):
            deal.load_state_dict(saved)
