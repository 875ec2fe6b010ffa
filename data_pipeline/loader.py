"""A data-parallel rank's training steps: its logical readers' streams in DataLoader
workers, whole steps assembled in the training process, the schedule kept in agreement.

Each worker serves a contiguous block of the rank's readers and yields, per training step,
one item: the windows of its readers' slots (`stream.slot_source` picks each slot's
source). A reader's slots of a source come from its own stream of that source
(`schedule.py` deals the stream its units, epoch after epoch); the worker reports where
each stream stands after the step and what it counted.

The training process assembles a step when it is asked for one, so a step exists whole or
not at all: a failing source (a DataFault in a worker, or too many unusable rows over all
ranks) is found before the step trains, and every rank learns of it at the same step. Per
step, one all-reduce over the ranks (`Collective`) sums the reports (positions, counts,
failures); every rank applies the sum to its replica of the schedule and sends it to its
workers, which apply it too: so every process takes the same decisions.

The state (`state_dict`) is the schedule (every stream's units and position), the counts
and the step: the same on every rank, and valid at any layout whose data-parallel size
divides the number of readers.
"""

from __future__ import annotations

import atexit
import copy
import functools
import logging
import multiprocessing
import os
import queue
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import fsspec.asyn
import numpy as np
import torch

from data_pipeline.errors import BadDataInput
from data_pipeline.failures import DataFault
from data_pipeline.schedule import Schedule
from data_pipeline.sources import Source
from data_pipeline.stream import (
    SKIPPED,
    UNIT_TALLIES,
    Position,
    StreamSettings,
    skip_problem,
    slot_source,
    slot_sources,
    stream_for,
)

log = logging.getLogger(__name__)

IGNORE = -100
"""Label of a position that is not trained on (padding)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
COUNTED = ("rows", "documents", "filtered", "held_out", *SKIPPED, "tokens", "samples", "labels",
           "step_documents", *UNIT_TALLIES)  # fmt: skip
"""The per-source counts summed over the ranks each step (data health, the skip check, the
padding: `labels` are the label slots that hold a token; `step_documents` the documents
with a token in the step, counted per stream)."""
HEALTH = COUNTED[: COUNTED.index("labels")]
"""The counts shown as data health (the rest serve the skip check and the padding)."""
STATE_FORMAT = 4
"""Version of `state_dict`'s structure (1: per-reader shares, before the schedule; 2: one
document open per stream, before its lanes; 3: one epoch's lists at a time, with a tail)."""


def worker_init(shutdown, worker_id: int = 0) -> None:
    """DataLoader worker start-up. Stop signals are the trainer's to handle (it finishes
    its step, saves, then shuts its workers down): a SIGTERM, SIGUSR1 or SIGINT that
    reaches a worker is passed on to its trainer, whether it reached the trainer too (the
    whole process group: SLURM, scancel, Ctrl-C; the trainer takes a repeat as the same
    request) or this worker alone; the worker itself reads on. A SIGTERM once the trainer
    is shutting down (`shutdown` set) does end the worker: it is how DataLoader and
    multiprocessing stop workers. And fsspec's lock may have been held by the parent's
    event-loop thread when it forked: a fresh one."""
    trainer = os.getppid()

    def on_signal(signum, frame):
        if signum == signal.SIGTERM and shutdown.is_set():
            os._exit(0)
        if os.getppid() == trainer:  # (a trainer gone: nobody to tell)
            os.kill(trainer, signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    fsspec.asyn.reset_lock()


@dataclass
class Collective:
    """How the ranks of a run agree (the trainer provides it; one process needs none)."""

    sum: Callable[[torch.Tensor], torch.Tensor]
    """Sums an int64 tensor over every rank of the job."""
    gather: Callable[[object], list]
    """Every rank's value of a small picklable object."""
    replicas: int = 1
    """Ranks holding each data-parallel rank's readers (tensor x pipeline parallel)."""


SINGLE = Collective(sum=lambda t: t, gather=lambda x: [x])


@dataclass(frozen=True)
class ReaderSlots:
    """Which readers are this rank's, and which global window slots are each reader's."""

    readers: int
    """Logical readers of the run (R)."""
    global_batch: int
    """Windows per step over all ranks (G, a multiple of R)."""
    dp_rank: int
    dp_size: int

    @functools.cached_property
    def per_reader(self) -> int:
        return self.global_batch // self.readers

    @property
    def mine(self) -> range:
        share = self.readers // self.dp_size
        return range(self.dp_rank * share, (self.dp_rank + 1) * share)

    def slots(self, step: int, reader: int) -> range:
        """Global slot indices of `reader`'s windows in step `step`."""
        first = step * self.global_batch + reader * self.per_reader
        return range(first, first + self.per_reader)


@dataclass
class Fault:
    """What a worker yields once a source failed."""

    message: str


@dataclass
class Block:
    """What one worker produced for one step."""

    step: int
    windows: dict[int, list]
    """Per reader of the worker, its slots' windows in order (None: padding)."""
    origins: dict[int, list]
    """Per reader, each slot's (source, epoch, stream, step, offset in the stream's step,
    pieces): the window's pieces, ((epoch, unit, row) of a document, first token, tokens)
    each (prepared data: ((epoch, unit, document), ...)); its epoch, that of its first."""
    reports: list[dict[int, Position]]
    """Per source, the positions of the streams this worker reports."""
    counts: list[Counter]
    """Per source, the counts of the streams this worker reports (rows before their
    positions, units finished) and the labels of its readers' windows."""
    first_bad: list[str | None]
    """Per source, where the streams read by this worker met their first unusable row."""


class StepMaker:
    """Produces one worker's blocks, step after step, from a replica of the schedule that
    the training process's reports keep up to date (`inbox`: each step's summed report)."""

    def __init__(self, sources, units, weights, tokenizer, settings, slots, readers, schedule,
                 inbox, shutdown=None):  # fmt: skip
        self.sources, self.units, self.weights = sources, units, list(weights)
        self.tokenizer, self.settings, self.slots = tokenizer, settings, slots
        self.readers, self.schedule, self.inbox = list(readers), schedule, inbox
        self.shutdown, self.parent = shutdown, os.getppid()
        self.streams: dict[tuple[int, int], object] = {}  # (source, reader): its stream
        self.first_bad: list[str | None] = [None] * len(sources)
        self.producing = schedule.step

    def make(self, step: int) -> Block:
        """The block of `step` (the steps are made in order)."""
        self.producing = step
        while self.schedule.step < step - 1:  # (see Schedule.commit)
            self._apply_next()
        block = Block(step, {r: [] for r in self.readers}, {r: [] for r in self.readers},
                      [{} for _ in self.sources], [Counter() for _ in self.sources],
                      [None] * len(self.sources))  # fmt: skip
        slots = self._slot_sources(step, self.readers)
        for s in range(len(self.sources)):
            if self.schedule.step < step and any((s, h) not in self.streams for h in self.readers):
                while self.schedule.step < step:  # a new stream starts where this step's
                    self._apply_next()  # schedule has it
            for h in self.readers:
                self._run(block, s, h, step, slots[h])
        return block

    def _run(self, block: Block, s: int, h: int, step: int, slots: list[int]) -> None:
        """Stream h's windows of this step, for its reader h."""
        deal = self.schedule.deals[s]
        if (s, h) not in self.streams:
            position = Position.unpack(deal.positions[h])
            unit_at = functools.partial(self._unit_at, s, h)
            key = (self.settings.seed, s, h)  # the stream's draws
            self.streams[(s, h)] = stream_for(self.sources[s], self.units[s], self.tokenizer,
                                              self.settings, position, unit_at, key)  # fmt: skip
        stream = self.streams[(s, h)]
        counts_before = stream.counts()
        documents = set()
        for offset, i in enumerate(i for i, source in enumerate(slots) if source == s):
            window = stream.next_window()
            pieces = self._pieces(deal, h, stream.pieces) if window is not None else ()
            documents.update(doc for doc, _, _ in pieces)
            epoch = pieces[0][0][0] if pieces else deal.epoch
            block.windows[h].append((i, window))
            block.origins[h].append((i, (s, epoch, h, step, offset, pieces)))
            if window is not None:
                block.counts[s]["labels"] += max(len(window) - 1, 0)
        position = stream.position()
        block.reports[s][h] = position
        counts = stream.counts()
        counts.subtract(counts_before)
        counts.update(stream.finished_units(position.unit), step_documents=len(documents))
        block.counts[s].update(counts)
        if stream.first_bad and not self.first_bad[s]:
            self.first_bad[s] = block.first_bad[s] = stream.first_bad

    @staticmethod
    def _pieces(deal, h: int, pieces) -> tuple:
        """A window's pieces with each document named by (epoch, unit, its place in the
        unit) instead of the stream's list index: the same document in every epoch's
        reading, wherever it was dealt."""
        return tuple(((*deal.unit_of(h, doc[0]), *doc[1:]), first, n) for doc, first, n in pieces)

    def _slot_sources(self, step: int, readers: Sequence[int]) -> dict[int, list[int]]:
        """The source of each slot of `readers` in step `step`."""
        per_reader = self.slots.per_reader
        if len(self.weights) == 1:
            return dict.fromkeys(readers, [0] * per_reader)
        first = np.array([self.slots.slots(step, r).start for r in readers])
        slots = (first[:, None] + np.arange(per_reader)).ravel()
        sources = slot_sources(slots, self.weights).reshape(len(readers), per_reader).tolist()
        return dict(zip(readers, sources, strict=True))

    def _unit_at(self, s: int, h: int, k: int) -> int | None:
        """Unit k of stream h's list, as the schedule of the step being made has it."""
        deal = self.schedule.deals[s]
        while k >= deal.lengths[h] and self.schedule.step < self.producing:
            self._apply_next()
        found = deal.unit_of(h, k)
        return None if found is None else found[1]

    def _apply_next(self) -> None:
        """Wait for the next step's summed report and apply it. A worker whose trainer
        is shutting down, or gone, ends here (it may wait here for a long time)."""
        while True:
            try:
                total = self.inbox.get(timeout=1.0)
                break
            except queue.Empty:
                if (self.shutdown is not None and self.shutdown.is_set()) or (
                    os.getppid() != self.parent
                ):
                    os._exit(0)
        apply_report(self.schedule, total)


class ReaderWorkers(torch.utils.data.IterableDataset):
    """This rank's readers; in each DataLoader worker a contiguous block of them, producing
    one Block per step, or a Fault once a source fails."""

    def __init__(self, sources, units, weights, tokenizer, settings, slots, schedule, inboxes,
                 shutdown=None):  # fmt: skip
        self.sources, self.units, self.weights = sources, units, weights
        self.tokenizer, self.settings, self.slots = tokenizer, settings, slots
        self.schedule, self.inboxes, self.shutdown = schedule, inboxes, shutdown

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        readers = list(self.slots.mine)
        block = readers[worker * len(readers) // workers : (worker + 1) * len(readers) // workers]
        maker = StepMaker(
            self.sources, self.units, self.weights, self.tokenizer, self.settings, self.slots,
            block, self.schedule, self.inboxes[worker], self.shutdown,
        )  # fmt: skip
        step = self.schedule.step
        try:
            while True:
                yield maker.make(step)
                step += 1
        except Exception as err:  # any failure of reading is the data's: told, not raised
            message = str(err) if isinstance(err, DataFault) else f"{type(err).__name__}: {err}"
            yield Fault(message)


def report_length(schedule: Schedule) -> int:
    """Integers in a step's summed report: per source the streams' positions and the
    counts; then whether a rank failed."""
    return len(schedule.deals) * (schedule.report_size() + len(COUNTED)) + 1


def apply_report(schedule: Schedule, total: np.ndarray) -> list[bool]:
    """Commit a step's summed report to a schedule; per source, whether an epoch began."""
    positions, counts = split_report(schedule, total)
    return schedule.commit(
        positions, [c["unit_tokens"] for c in counts], [c["unit_rows"] for c in counts]
    )


def split_report(schedule: Schedule, total: np.ndarray) -> tuple[list[np.ndarray], list[dict]]:
    """(per source: the positions block, the counts) of a summed report."""
    per_source = schedule.report_size() + len(COUNTED)
    positions, counts = [], []
    for s in range(len(schedule.deals)):
        part = total[s * per_source : (s + 1) * per_source]
        positions.append(part[: schedule.report_size()])
        counts.append(dict(zip(COUNTED, part[schedule.report_size() :].tolist(), strict=True)))
    return positions, counts


class TrainData:
    """This data-parallel rank's training steps: `next_step()` returns the step's
    micro-batches (tokens, labels; labels IGNORE where padded), int64 [micro, seq_len].

    All ranks must call next_step() together (it agrees on the schedule and on faults)."""

    def __init__(
        self,
        sources: Sequence,
        units: Sequence[Sequence],
        weights: Sequence[float],
        tokenizer,
        settings: StreamSettings,
        slots: ReaderSlots,
        micro_batch_size: int,
        num_workers: int,
        device: torch.device,
        basis: dict,
        *,
        max_skipped_fraction: float = 1.0,
        skip_check_min_rows: int = 1000,
        collective: Collective = SINGLE,
    ):
        if slots.readers % slots.dp_size or slots.global_batch % slots.readers:
            raise BadDataInput(
                f"{slots.readers} readers cannot serve {slots.dp_size} data-parallel ranks "
                f"and a global batch of {slots.global_batch}"
            )
        for source, source_units in zip(sources, units, strict=True):
            if not source_units:
                raise BadDataInput(f"{source.cfg.uri}: no {settings.split} data to read")
        self.sources, self.units, self.weights = list(sources), list(units), list(weights)
        self.tokenizer, self.settings, self.slots = tokenizer, settings, slots
        self.micro, self.device, self.collective = micro_batch_size, device, collective
        self.basis = dict(basis)
        """What the positions of a saved state are positions of (readers, batch, sources,
        their files and units, ...): a state continues only where all of it is the same."""
        self.max_skipped_fraction, self.skip_check_min_rows = (
            max_skipped_fraction,
            skip_check_min_rows,
        )
        # workers beyond one per reader would have nothing to read
        self.num_workers = min(num_workers, len(slots.mine))
        self.schedule = Schedule(
            [[unit.size for unit in source_units] for source_units in units],
            [source.tokens_per_size(settings.window) for source in sources],
            weights, slots.readers, slots.per_reader, settings.window, settings.seed,
            settings.lanes,
        )  # fmt: skip
        self.totals = [Counter() for _ in sources]
        self.first_bad: list[tuple[int, str] | None] = [None] * len(sources)
        self._padding = [0, 0]  # label slots since stats(): [filled, all]
        self._documents = [0, 0]  # since stats(): [documents feeding the steps, steps]
        self.origins: dict[int, list] = {}
        """Per reader of this rank, where each window of the last step came from:
        (source, epoch, stream, step, offset in the stream's step, pieces; see Block)."""
        self._loader, self._shutdown, self._inboxes = None, None, []

    @property
    def step(self) -> int:
        return self.schedule.step

    # the step -------------------------------------------------------------------------

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches. Raises DataFault on every rank if a source
        failed on any rank or too many of a source's rows were unusable; the state is then
        still that after the last complete step (nothing of this step is committed)."""
        step, blocks, fault = self.step, [], None
        try:
            blocks = self._blocks(step)
        except DataFault as err:
            fault = str(err)
        report = self._report(blocks, fault is not None)
        total = (self.collective.sum(torch.from_numpy(report)) // self.collective.replicas).numpy()
        if total[-1]:
            self.close()  # its workers' positions are past the saved state
            messages = [m for m in self.collective.gather(fault) if m]
            raise DataFault(fault or messages[0])
        _, counts = split_report(self.schedule, total)
        totals = [self.totals[s] + Counter(c) for s, c in enumerate(counts)]
        for blk in blocks:
            for s, where in enumerate(blk.first_bad):
                if where and not self.first_bad[s]:
                    self.first_bad[s] = (step, where)
        self._judge(totals)  # too many unusable rows: a DataFault on every rank
        turned = apply_report(self.schedule, total)
        for inbox in self._inboxes:
            inbox.put(total)
        self.totals = totals
        self._count_padding(step, counts, turned)
        return self._micro_batches(self._windows(blocks))

    def _blocks(self, step: int) -> list[Block]:
        """Every worker's block of `step` (the loader yields them in worker order)."""
        self.start()
        blocks = []
        while len(blocks) < max(self.num_workers, 1):
            item = next(self._loader)
            if isinstance(item, Fault):
                raise DataFault(item.message)
            if item.step != step:
                raise RuntimeError(f"loader produced step {item.step} for step {step}")
            blocks.append(item)
        return blocks

    def _report(self, blocks: list[Block], failed: bool) -> np.ndarray:
        """This rank's part of the step's report (see report_length)."""
        schedule = self.schedule
        report = np.zeros(report_length(schedule), dtype=np.int64)
        per_source = schedule.report_size() + len(COUNTED)
        for blk in blocks:
            for s in range(len(self.sources)):
                base = s * per_source
                fields = schedule.fields
                for h, position in blk.reports[s].items():
                    row = base + h * (1 + fields)
                    report[row] = 1
                    report[row + 1 : row + 1 + fields] = position.pack(self.settings.lanes)
                counts = base + schedule.report_size()
                report[counts : counts + len(COUNTED)] += [blk.counts[s][c] for c in COUNTED]
        report[-1] = int(failed)
        return report

    def _judge(self, totals: list[Counter]) -> None:
        for s, source in enumerate(self.sources):
            # judged on a fair sample: enough rows over enough units, or every row once
            whole = self.schedule.deals[s].oldest_epoch() > 0
            problem = skip_problem(
                source.cfg.uri, totals[s], self.max_skipped_fraction,
                self.skip_check_min_rows, whole=whole,
            )  # fmt: skip
            if problem:
                self.close()
                seen = [w for w in self.collective.gather(self.first_bad[s]) if w]
                where = f"; the first at {min(seen)[1]}" if seen else ""
                raise DataFault(problem + where)

    def _count_padding(self, step: int, counts: list[dict], turned: list[bool]) -> None:
        """Padding of the step (all ranks' label slots) and the documents feeding it, for
        the metrics; an epoch's turn is logged."""
        seq_len, batch = self.settings.window - 1, self.slots.global_batch
        if len(self.sources) == 1:
            slots = Counter({0: batch})
        else:
            slots = Counter(
                slot_source(n, self.weights) for n in range(step * batch, step * batch + batch)
            )
        self._documents[0] += sum(c["step_documents"] for c in counts)
        self._documents[1] += 1
        for s, source in enumerate(self.sources):
            self._padding[0] += counts[s]["labels"]
            self._padding[1] += slots[s] * seq_len
            if turned[s]:
                log.info("%s: epoch %d begins", source.cfg.uri, self.schedule.deals[s].epoch)

    def _windows(self, blocks: list[Block]) -> list:
        """The step's windows in slot order (this rank's readers, each reader's slots)."""
        by_reader = {}
        for blk in blocks:
            for reader, windows in blk.windows.items():
                by_reader[reader] = [w for _, w in sorted(windows, key=lambda x: x[0])]
        self.origins = {}
        for blk in blocks:
            for reader, origins in blk.origins.items():
                self.origins[reader] = [o for _, o in sorted(origins, key=lambda x: x[0])]
        return [w for reader in self.slots.mine for w in by_reader[reader]]

    def start(self) -> None:
        """Start the loader workers now, not at the next step: from the thread that should
        fork them (two threads forking at once leak each one's pipes into the other's
        workers, so that stopping a worker waits for the other's to end)."""
        if self._loader is None:
            self._start_workers()

    def _micro_batches(self, windows: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Windows (None: padding) -> micro-batches of (tokens, labels), padded windows
        masked with IGNORE labels."""
        seq_len = self.settings.window - 1
        inputs = np.zeros((len(windows), seq_len), dtype=np.int64)
        labels = np.full((len(windows), seq_len), IGNORE, dtype=np.int64)
        for i, window in enumerate(windows):
            if window is not None and len(window):  # (one token: an input, no label)
                inputs[i, : min(len(window), seq_len)] = window[:seq_len]
                labels[i, : len(window) - 1] = window[1:]
        out = []
        for start in range(0, len(windows), self.micro):
            pair = (inputs[start : start + self.micro], labels[start : start + self.micro])
            out.append(tuple(torch.from_numpy(x).to(self.device, non_blocking=True) for x in pair))
        return out

    # workers --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (the next step starts new ones at the saved positions)."""
        if self._shutdown is not None:
            self._shutdown.set()
            atexit.unregister(self._shutdown.set)
        self._loader, self._shutdown, self._inboxes = None, None, []

    def __del__(self) -> None:
        # before the DataLoader stops its workers with SIGTERM, which a worker not told of
        # the shutdown takes for a stop request and passes on to this process
        self.close()

    def _start_workers(self) -> None:
        replica = copy.deepcopy(self.schedule)  # what the workers keep up to date
        if self.num_workers == 0:
            self._inboxes = [queue.Queue()]
            self._loader = iter(
                ReaderWorkers(
                    self.sources, self.units, self.weights, self.tokenizer, self.settings,
                    self.slots, replica, self._inboxes,
                )
            )  # fmt: skip
            return
        context = multiprocessing.get_context()
        self._inboxes = [context.Queue() for _ in range(self.num_workers)]
        for inbox in self._inboxes:
            inbox.cancel_join_thread()  # a worker that ended must not hold up this process's exit
        shutdown = self._shutdown = context.Event()
        # set when this process exits (see worker_init); registered after multiprocessing's
        # own exit handler, which terminates the workers, so it runs before it
        atexit.register(shutdown.set)
        dataset = ReaderWorkers(
            self.sources, self.units, self.weights, self.tokenizer, self.settings, self.slots,
            replica, self._inboxes, shutdown,
        )  # fmt: skip
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            worker_init_fn=functools.partial(worker_init, shutdown),
            prefetch_factor=2,
        )
        self._loader = iter(loader)

    # state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The data position after the last complete step: the same on every rank."""
        return {
            "format": STATE_FORMAT,
            "basis": dict(self.basis),
            "schedule": self.schedule.state_dict(),
            "totals": [dict(t) for t in self.totals],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state saved at any layout of the same data (one saved before
        streams kept several documents open continues at its position with this run's
        `data.open_documents`)."""
        if state.get("format") == 2:
            state = one_document_state(state, self.settings.lanes)
        if state.get("format") == 3:
            state = overlapping_state(state, [len(units) for units in self.units])
        if state.get("format") != STATE_FORMAT:
            raise BadDataInput(
                "the data state was written by an earlier belief-lm (its readers had fixed "
                "shares of each epoch); its position cannot be continued by this version"
            )
        saved = dict(state.get("basis", state.get("layout", {})))  # ("layout" until format 4)
        saved.setdefault("open_documents", self.basis["open_documents"])  # (format 2)
        lines_cut = any(
            isinstance(source, Source) and source.cut_at_line_starts(units)
            for source, units in zip(self.sources, self.units, strict=True)
        )
        if "cuts" not in saved and not lines_cut:  # saved before line files were cut at
            saved = {**saved, "cuts": self.basis["cuts"]}  # line starts: the same cuts
        for key, value in self.basis.items():
            if key == "cuts" and saved.get(key) != value:
                raise BadDataInput(
                    "data state was saved when the sources' files were cut into other units "
                    "(by a belief-lm that cut line files at fixed bytes, not at line starts): "
                    "the stream cannot continue exactly"
                )
            if saved.get(key) != value:
                raise BadDataInput(
                    f"data state was saved with {key}={saved.get(key)!r}, this run has "
                    f"{key}={value!r}: the stream cannot continue exactly"
                )
        self.schedule.load_state_dict(state["schedule"])
        self.totals = [Counter(t) for t in state["totals"]]
        self.close()  # the next step starts workers at these positions

    def stats(self) -> dict[str, float]:
        """Data health over all ranks as of the last step: per source rows, documents,
        skipped (by reason), tokens and epoch, as 'data/<source>/<count>'; since the last
        call, 'data/padding', the share of label slots without a token, and
        'data/documents_per_step', the documents with a token in a step on average (over
        the global batch; a prepared source's counted per reader)."""
        stats = self._health()
        if self._padding[1]:
            stats["data/padding"] = 1 - self._padding[0] / self._padding[1]
        if self._documents[1]:
            stats["data/documents_per_step"] = self._documents[0] / self._documents[1]
        self._padding, self._documents = [0, 0], [0, 0]
        return stats

    def _health(self) -> dict[str, float]:
        health = {}
        for s, totals in enumerate(self.totals):
            health.update({f"data/{s}/{k}": float(totals[k]) for k in HEALTH if totals[k]})
            health[f"data/{s}/epoch"] = float(self.schedule.deals[s].epoch)
            health[f"data/{s}/skipped"] = float(sum(totals[k] for k in SKIPPED))
        return health


FORMAT3_AHEAD = 4
"""The column of a format-3 position that said how much an epoch's tail had left."""


def one_document_state(state: dict, lanes: int) -> dict:
    """A data state of format 2 (a stream held one document: `(unit, row, token,
    unit_tokens, unit_bad, ahead)` per stream) as one of format 3 for streams of `lanes`
    lanes: a stream's document, if begun, open in its first lane, its cursor at the next
    row. Its open tokens are -1 until the stream reports them: the stream remade there adds
    the tokens it has left to its unit's tally, which counted only the tokens taken."""
    state = copy.deepcopy(state)
    for deal in state["schedule"]["sources"]:
        packed, old = [], np.asarray(deal["positions"]).tolist()
        for unit, row, token, unit_tokens, unit_bad, ahead in old:
            begun = int(token > 0)
            lane = ((0, unit, row, token),) if begun else ()
            position = Position(unit, row + begun, unit_tokens, unit_bad, -begun, lanes=lane)
            values = position.pack(lanes)
            packed.append([*values[:FORMAT3_AHEAD], ahead, *values[FORMAT3_AHEAD:]])
        deal["positions"] = np.array(packed, dtype=np.int64)
    return {**state, "format": 3}


def overlapping_state(state: dict, units: Sequence[int]) -> dict:
    """A data state of format 3 (an epoch's lists of units, readers joining other streams
    in its tail) as one of this format (`units`: each source's number of units): each
    stream's list becomes entries of its epoch, its position loses the tail's column, and
    every reader reads its own stream on (a stream some joined in the tail is then read
    by its own reader alone: every document is still read once)."""
    state = copy.deepcopy(state)
    for deal, count in zip(state["schedule"]["sources"], units, strict=True):
        positions = np.delete(np.asarray(deal["positions"]), FORMAT3_AHEAD, axis=1)
        entries = np.asarray(deal.pop("units"), dtype=np.int64) + deal["epoch"] * count
        for key in ("follow", "emptied"):
            deal.pop(key)
        deal.setdefault("finished_rows", 0)  # (format 2: not counted)
        deal.update(entries=entries, bases=np.zeros(len(positions), np.int64), positions=positions)
    return {**state, "format": STATE_FORMAT}
