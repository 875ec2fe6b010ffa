"""The schedule: which units each stream reads, epoch after epoch, without a tail.

A run has R logical readers; every step, reader r fills its slots of each source from its
own stream r (`stream.SourceStream`). The schedule deals out the source's units to the
streams as they need them: each epoch's units wait in a seeded order (the *queue*), and
after every step each stream whose estimated work falls below TARGET_STEPS steps is handed
the next ones. So readers never wait for a slow share: whichever stream runs low takes the
next unit, and every unit of an epoch is read by exactly one stream.

When an epoch's queue is empty, the next epoch's order is dealt on at once: a stream that
runs low takes the next epoch's units while others still read their last units of the
last one. Epochs overlap at the turn instead of narrowing to the few streams (and at the
end the one long document) that have work left, so every step draws on every stream,
the turn included, and no step is padded for lack of work. Each document is still read
once per epoch: a stream's list holds *entries* (epoch x units + unit), each unit of an
epoch dealt to one stream.

A stream's position is its cursor (the list index of the unit it reads, where its next
document to open is) with the tokens of the documents it holds open (`stream.Position`):
the entries before the cursor are passed. Entries before both the cursor and every open
document are dropped (the stream's *base* counts them): list indices in positions stay
absolute, and the state stays a few integers per reader however long the run.

The schedule changes only at `commit`, once per step, from what the step's streams report
(their positions after it, and the tallies of the units they finished) summed over the
ranks: every rank and every loader worker holds a replica and applies the same reports, so
all of them agree on every decision, and the decisions depend on the data and the step
alone, never on the number of ranks or workers. A checkpoint holds the state once, valid at
any layout.

Estimates are tokens: a unit's size (bytes or characters of text, samples of prepared
data) times the source's tokens per size, measured on the units finished so far.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from data_pipeline.stream import (
    LANE_UNITS,
    UNIT,
    Position,
    epoch_order,
    position_fields,
)

UNITS_PER_READER = 8
"""Sources are cut into units of at most 1/(readers x this) of their size: enough units for
every stream to start on its own, and small enough that the streams' shares of an epoch
stay even. Not finer: pieces of one parquet row group each decode the rows before them."""
TARGET_STEPS = 4
"""Steps of estimated work a stream is kept supplied with (beyond what it reads in the
steps a loader worker runs ahead)."""
PRIOR_SHARE = 1 / 8
"""The first guess of tokens per size weighs as much as this share of a source, measured."""


@dataclass
class SourceDeal:
    """One source's deal: the epoch being dealt and its queue, every stream's list of
    entries and position."""

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
    """The epoch whose units are being dealt."""
    handed: int = 0
    """Units of that epoch's order dealt so far."""
    lists: list[list[int]] = field(default_factory=list)
    """Per stream, its entries (epoch x units + unit) from its base on, in order."""
    bases: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Per stream, the entries dropped before its list (passed, and no document open)."""
    positions: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    """Per stream, its packed Position (int64 [readers, position_fields(lanes)])."""
    finished_size: int = 0
    finished_tokens: int = 0
    """Sizes and tokens of the units finished so far (every epoch): the measured ratio."""
    finished_rows: int = 0
    """Rows of the units finished so far: with their tokens, the tokens of a document."""

    def __post_init__(self) -> None:
        self.total = int(self.sizes.sum())
        self.order = epoch_order(len(self.sizes), self.seed, self.epoch)
        # per stream (kept with lists and positions): its list's end (an absolute index),
        # the total size of its kept entries, the size of those before the cursor, and that
        # of the unit at the cursor (0: none yet)
        self.lengths = self.listed = self.passed = self.head = np.zeros(0, np.int64)

    def begin(self) -> None:
        """Start the run: epoch 0's order, empty streams, and the first units dealt."""
        self.epoch, self.handed = 0, 0
        self.order = epoch_order(len(self.sizes), self.seed, 0)
        self.lists = [[] for _ in range(self.readers)]
        self.bases = np.zeros(self.readers, dtype=np.int64)
        self.positions = np.tile(np.array(Position().pack(self.lanes)), (self.readers, 1))
        self._index()
        self.hand_out()

    def unit_of(self, h: int, k: int) -> tuple[int, int] | None:
        """(epoch, unit) of entry k of stream h's list, or None if it has none yet."""
        if k >= self.lengths[h]:
            return None
        return divmod(self.lists[h][k - self.bases[h]], len(self.sizes))

    def _size(self, entries: Sequence[int]) -> int:
        return int(self.sizes[np.asarray(entries, dtype=np.int64) % len(self.sizes)].sum())

    def _index(self) -> None:
        """The per-stream sums, from the lists, bases and positions."""
        self.lengths = self.bases + np.array([len(e) for e in self.lists], dtype=np.int64)
        self.listed = np.array([self._size(e) for e in self.lists], dtype=np.int64)
        at = (self.positions[:, UNIT] - self.bases).tolist()
        pairs = list(zip(self.lists, at, strict=True))
        self.passed = np.array([self._size(e[:k]) for e, k in pairs], dtype=np.int64)
        self.head = np.array([self._size(e[k : k + 1]) for e, k in pairs], dtype=np.int64)

    @property
    def ratio(self) -> float:
        """Tokens per size: measured on the finished units, with the first guess counted as
        if PRIOR_SHARE of the source had been read at it. The units that finish first are
        no fair sample (those with a held-out giant or an unusable row, the short ones), and
        on their own they made every unit look nearly empty: the whole queue was handed out
        in the first steps."""
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

    def queued(self) -> np.ndarray:
        """Per stream, the estimated tokens of the units it was handed and has not begun."""
        return (self.listed - self.passed - self.head) * self.ratio

    def hand_out(self) -> bool:
        """Deal units, one per needy stream per round in stream order, to every stream with
        less than TARGET_STEPS steps of estimated work beyond the unit it reads (whose end
        an estimate cannot foresee: a stream runs dry only if the units it was handed hold
        far less than their sizes promise), plus a document's for each of its lanes without
        one (so that it has documents to open them with: a stream with one document open
        and none to open draws its windows from it). An epoch's order dealt out, the next
        epoch's follows; True if one began. At most one epoch's units per call (units that
        hold nothing must not keep it dealing)."""
        units = len(self.sizes)
        empty = self.lanes - (self.positions[:, LANE_UNITS] >= 0).sum(axis=1)
        need = TARGET_STEPS * self.tokens_per_step + empty * self.document_tokens()
        remaining = self.queued()
        needy = np.nonzero(remaining < need)[0]
        turned, budget = False, units
        while len(needy) and budget:
            for h in needy[:budget]:
                if self.handed == units:
                    self.epoch, self.handed, turned = self.epoch + 1, 0, True
                    self.order = epoch_order(units, self.seed, self.epoch)
                unit = int(self.order[self.handed])
                self.handed += 1
                budget -= 1
                size = self.sizes[unit]
                if self.positions[h, UNIT] == self.lengths[h]:  # it waited at its list's end:
                    self.head[h] = size  # the unit it reads next (its work unforeseen)
                else:
                    remaining[h] += size * self.ratio
                self.lists[h].append(self.epoch * units + unit)
                self.lengths[h] += 1
                self.listed[h] += size
            needy = needy[remaining[needy] < need[needy]]
        return turned

    def _drop_passed(self, streams: np.ndarray) -> None:
        """Forget the entries of `streams` (a mask) before their cursor and every open
        document."""
        lanes = self.positions[:, LANE_UNITS]
        opened = np.where(lanes >= 0, lanes, np.iinfo(np.int64).max).min(axis=1)
        first = np.minimum(self.positions[:, UNIT], opened)
        for h in np.nonzero(streams & (first > self.bases))[0]:
            drop = int(first[h] - self.bases[h])
            size = self._size(self.lists[h][:drop])
            self.lists[h] = self.lists[h][drop:]
            self.bases[h] += drop
            self.listed[h] -= size
            self.passed[h] -= size

    def commit(
        self, reported: np.ndarray, positions: np.ndarray, tokens: int, rows: int = 0
    ) -> bool:
        """Apply the reports of a step (positions of the streams `reported`, tokens and rows
        of the units finished); True if the next epoch's dealing began."""
        for h in np.nonzero(reported & (positions[:, UNIT] != self.positions[:, UNIT]))[0]:
            base, old, new = self.bases[h], self.positions[h, UNIT], positions[h, UNIT]
            passed = self._size(self.lists[h][old - base : new - base])
            self.finished_size += passed
            self.passed[h] += passed
            self.head[h] = self._size(self.lists[h][new - base : new - base + 1])
        self.finished_tokens += tokens
        self.finished_rows += rows
        self.positions[reported] = positions[reported]
        self._drop_passed(reported)
        return self.hand_out()

    def oldest_epoch(self) -> int:
        """The earliest epoch a stream still reads (every epoch before it is complete)."""
        units = len(self.sizes)
        return min((e[0] // units for e in self.lists if e), default=self.epoch)

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch, "handed": self.handed,
            "entries": np.array([e for entries in self.lists for e in entries], dtype=np.int64),
            "lengths": np.array([len(e) for e in self.lists], dtype=np.int64),
            "bases": self.bases.copy(), "positions": self.positions.copy(),
            "finished_size": self.finished_size, "finished_tokens": self.finished_tokens,
            "finished_rows": self.finished_rows,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.handed = state["epoch"], state["handed"]
        self.order = epoch_order(len(self.sizes), self.seed, self.epoch)
        bounds = np.cumsum([0, *state["lengths"]]).tolist()
        entries = np.asarray(state["entries"]).tolist()
        self.lists = [entries[a:b] for a, b in itertools.pairwise(bounds)]
        self.bases = np.array(state["bases"], dtype=np.int64)
        self.positions = np.array(state["positions"], dtype=np.int64)
        self.finished_size, self.finished_tokens = state["finished_size"], state["finished_tokens"]
        self.finished_rows = state["finished_rows"]
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
            deal.begin()

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
        finished; per source, whether its next epoch's dealing began.

        A loader worker producing step s needs the schedule of step s - 1 only: a commit
        changes nothing a stream has begun to read but its list's growth (and a stream that
        reaches the end of its list waits for the commit that may extend it)."""
        turned = []
        rows = rows if rows is not None else [0] * len(self.deals)
        for deal, report, finished, read in zip(self.deals, reports, tokens, rows, strict=True):
            report = np.asarray(report).reshape(self.readers, 1 + self.fields)
            reported, positions = report[:, 0] > 0, report[:, 1:]
            turned.append(deal.commit(reported, positions, int(finished), int(read)))
        self.step += 1
        return turned

    def state_dict(self) -> dict:
        return {"step": self.step, "sources": [deal.state_dict() for deal in self.deals]}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        for deal, saved in zip(self.deals, state["sources"], strict=True):
            deal.load_state_dict(saved)
