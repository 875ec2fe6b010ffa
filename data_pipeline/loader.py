"""A data-parallel rank's training steps: its logical readers in DataLoader workers, whole
steps assembled in the training process, exact positions, global epochs, data faults.

Each worker runs a contiguous block of the rank's readers and yields, per training step,
one item: the windows its readers produce for that step's slots (`stream.slot_source`
picks each slot's source). The training process keeps them per (reader, source) and
assembles a step when it is asked for one, so a step either exists whole or not at all:
a failing source (a DataFault in a worker, or too many unusable rows over all ranks) is
found before the step trains, and every rank learns of it at the same step.

Per step, one all-reduce over the data-parallel ranks (`Collective`) sums, per source,
the readers that finished the current epoch and the rows read, skipped and used; when
every reader of a source has finished, the next epoch begins for all of them. A reader
that finished early fills its slots with padding (inputs masked from the loss) meanwhile.

The state (`state_dict`) is the position of every reader of this rank after the last
complete step, the epochs and the step; the trainer gathers all ranks' into one, and any
layout whose data-parallel size divides the number of readers continues from it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import fsspec.asyn
import numpy as np
import torch

from data_pipeline.sources import DataFault
from data_pipeline.stream import SKIPPED, StreamSettings, skip_problem, slot_source, stream_for

log = logging.getLogger(__name__)

IGNORE = -100
"""Label of a position that is not trained on (padding)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
COUNTED = ("rows", "documents", "filtered", "held_out", *SKIPPED, "tokens", "samples")
"""The per-source counts summed over the ranks each step (data health)."""


_SHUTDOWNS: list = []
"""The shutdown events of this process's workers, set when it exits (see worker_init)."""


@atexit.register  # runs before multiprocessing's own exit handler terminates the workers
def _workers_may_stop() -> None:
    for event in _SHUTDOWNS:
        event.set()


def worker_init(shutdown, worker_id: int = 0) -> None:
    """DataLoader worker start-up. Stop signals are the trainer's to handle (it finishes
    its step, saves, then shuts its workers down): a SIGTERM, SIGUSR1 or SIGINT sent to
    the whole process group (SLURM, scancel, Ctrl-C) must not kill a worker mid-step. A
    SIGTERM once the trainer is shutting down (`shutdown` set) does end the worker: it is
    how DataLoader and multiprocessing stop workers. And fsspec's lock may have been held
    by the parent's event-loop thread when it forked: a fresh one."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)

    def on_term(signum, frame):
        if shutdown.is_set():
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
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
class Plan:
    """Which readers and slots are this rank's."""

    readers: int
    """Logical readers of the run (R)."""
    global_batch: int
    """Windows per step over all ranks (G, a multiple of R)."""
    dp_rank: int
    dp_size: int

    @property
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


class ReaderWorkers(torch.utils.data.IterableDataset):
    """The streams of this rank's readers; in each DataLoader worker a contiguous block
    of them, producing one item per step: [(reader, source, Window), ...] in slot order,
    or ('fault', message) once a source fails."""

    def __init__(
        self,
        sources: Sequence,
        weights: Sequence[float],
        tokenizer,
        settings: StreamSettings,
        plan: Plan,
        states: dict,
        step: int,
    ):
        self.sources, self.weights, self.tokenizer = list(sources), list(weights), tokenizer
        self.settings, self.plan, self.states, self.step = settings, plan, states, step

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        readers = list(self.plan.mine)
        block = readers[worker * len(readers) // workers : (worker + 1) * len(readers) // workers]
        streams = {
            (r, s): stream_for(
                source, self.tokenizer, r, self.settings, self.states.get(r, {}).get(s)
            ).windows()
            for r in block
            for s, source in enumerate(self.sources)
        }
        step = self.step
        try:
            while True:
                item = []
                for r in block:
                    for slot in self.plan.slots(step, r):
                        s = slot_source(slot, self.weights)
                        item.append((r, s, next(streams[(r, s)])))
                yield item
                step += 1
        except Exception as err:  # any failure of reading is the data's: told, not raised
            message = str(err) if isinstance(err, DataFault) else f"{type(err).__name__}: {err}"
            yield ("fault", message)


class TrainData:
    """This data-parallel rank's training steps: `next_step()` returns the step's
    micro-batches (tokens, labels; labels IGNORE where padded), int64 [micro, seq_len].

    All ranks must call next_step() together (it agrees on epochs and faults)."""

    def __init__(
        self,
        sources: Sequence,
        weights: Sequence[float],
        tokenizer,
        settings: StreamSettings,
        plan: Plan,
        micro_batch_size: int,
        num_workers: int,
        device: torch.device,
        layout: dict,
        *,
        max_skipped_fraction: float = 1.0,
        skip_check_min_rows: int = 1000,
        collective: Collective = SINGLE,
    ):
        if plan.readers % plan.dp_size or plan.global_batch % plan.readers:
            raise ValueError(
                f"{plan.readers} readers cannot serve {plan.dp_size} data-parallel ranks "
                f"and a global batch of {plan.global_batch}"
            )
        self.sources, self.weights, self.tokenizer = list(sources), list(weights), tokenizer
        self.settings, self.plan, self.micro = settings, plan, micro_batch_size
        self.device, self.layout, self.collective = device, dict(layout), collective
        self.max_skipped_fraction, self.skip_check_min_rows = (
            max_skipped_fraction,
            skip_check_min_rows,
        )
        # workers beyond one per reader would have nothing to read
        self.num_workers = min(num_workers, len(plan.mine))
        self.step, self.epochs = 0, [0] * len(self.sources)
        self.states: dict[int, dict[int, dict]] = {r: {} for r in plan.mine}
        self.finished: dict[int, set[int]] = {r: set() for r in plan.mine}
        self.health: dict[str, float] = {}
        self._loader, self._shutdown = None, None

    # the step -------------------------------------------------------------------------

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches. Raises DataFault on every rank if a source
        failed on any rank or too many of a source's rows were unusable; the state is then
        still that after the last complete step (nothing of this step is committed)."""
        staged, fault = None, None
        try:
            staged = self._stage()
        except DataFault as err:
            fault = str(err)
        states = dict(self.states)
        finished = {r: set(f) for r, f in self.finished.items()}
        if staged is not None:
            for (r, s), state in staged[1].items():
                states[r] = {**states[r], s: state}
            for r, s in staged[2]:
                finished[r].add(s)
        done, counts, any_fault = self._agree(states, finished, fault is not None)
        if any_fault:
            self.close()  # its workers' positions are past the saved state
            messages = [m for m in self.collective.gather(fault) if m]
            raise DataFault(fault or messages[0])
        # a source whose every reader finished the epoch begins the next one, for all
        ended = [done[s] == self.plan.readers for s in range(len(self.sources))]
        epochs = [e + end for e, end in zip(self.epochs, ended, strict=True)]
        self._judge(counts, epochs)  # too many unusable rows: a DataFault on every rank
        self.states, self.finished, self.epochs = states, finished, epochs
        for s, source in enumerate(self.sources):
            if ended[s]:
                for readers_done in self.finished.values():
                    readers_done.discard(s)
                log.info("%s: epoch %d begins", source.cfg.uri, self.epochs[s])
        self._record_health(counts)
        self.step += 1
        return self._micro_batches(staged[0])

    def _agree(self, states: dict, finished: dict, failed: bool):
        """The one collective of a step: per source, the readers that finished the epoch and
        the counts of all readers (each counted once), and whether any rank failed."""
        n = len(self.sources)
        local = np.zeros((n, 1 + len(COUNTED)), dtype=np.int64)
        for r, by_source in states.items():
            for s in range(n):
                local[s, 0] += s in finished[r]
                source_counts = by_source.get(s, {}).get("counts", {})
                local[s, 1:] += [source_counts.get(name, 0) for name in COUNTED]
        flat = np.concatenate([local.ravel(), [int(failed)]])
        total = self.collective.sum(torch.from_numpy(flat)).numpy()
        any_fault = bool(total[-1])
        total = (total[:-1] // self.collective.replicas).reshape(n, -1)
        counts = [dict(zip(COUNTED, row[1:].tolist(), strict=True)) for row in total]
        return total[:, 0], counts, any_fault

    def _judge(self, counts: list[dict], epochs: list[int]) -> None:
        for s, source in enumerate(self.sources):
            # judged on a fair sample: enough rows, or every row once (a complete epoch)
            problem = skip_problem(
                source.cfg.uri, counts[s], self.max_skipped_fraction,
                self.skip_check_min_rows, whole=epochs[s] > 0,
            )  # fmt: skip
            if problem:
                self.close()
                raise DataFault(problem)

    def _record_health(self, counts: list[dict]) -> None:
        self.health = {}
        for s, source_counts in enumerate(counts):
            self.health.update({f"data/{s}/{k}": float(v) for k, v in source_counts.items() if v})
            self.health[f"data/{s}/epoch"] = float(self.epochs[s])
            skipped = sum(source_counts[k] for k in SKIPPED)
            self.health[f"data/{s}/skipped"] = float(skipped)

    def start(self) -> None:
        """Start the loader workers now, not at the next step: from the thread that should
        fork them (two threads forking at once leak each one's pipes into the other's
        workers, so that stopping a worker waits for the other's to end)."""
        if self._loader is None:
            self._start_workers()

    def _stage(self):
        """The step's windows, in slot order, and the states and finished epochs they
        would commit (nothing is committed until every rank has its step)."""
        self.start()
        windows, states, finished = [], {}, set()
        for r in self.plan.mine:
            for slot in self.plan.slots(self.step, r):
                s = slot_source(slot, self.weights)
                if s in self.finished[r] or (r, s) in finished:
                    windows.append(None)  # this reader has read its share of the epoch
                    continue
                window = self._next_window(r, s)
                windows.append(window.tokens)
                states[(r, s)] = window.state
                if window.last:
                    finished.add((r, s))
        return windows, states, finished

    def _next_window(self, reader: int, source: int):
        queue = self._queues[(reader, source)]
        while not queue:
            item = next(self._loader)
            if item[0] == "fault":
                raise DataFault(item[1])
            for r, s, window in item:
                self._queues[(r, s)].append(window)
        return queue.popleft()

    def _micro_batches(self, windows: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Windows (None: padding) -> micro-batches of (tokens, labels), padded windows
        masked with IGNORE labels."""
        size = self.settings.window
        tokens = np.zeros((len(windows), size), dtype=np.int64)
        labels = np.full((len(windows), size), IGNORE, dtype=np.int64)
        for i, window in enumerate(windows):
            if window is not None and len(window):
                tokens[i, : len(window)] = window
                labels[i, : len(window)] = window
        inputs = torch.from_numpy(tokens[:, :-1])
        targets = torch.from_numpy(labels[:, 1:].copy())
        out = []
        for start in range(0, len(windows), self.micro):
            part = slice(start, start + self.micro)
            pair = (inputs[part].contiguous(), targets[part].contiguous())
            out.append(tuple(x.to(self.device, non_blocking=True) for x in pair))
        return out

    # workers --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (the next step starts new ones at the saved positions)."""
        if self._shutdown is not None:
            self._shutdown.set()
        self._loader, self._shutdown = None, None

    def _start_workers(self) -> None:
        dataset = ReaderWorkers(
            self.sources, self.weights, self.tokenizer, self.settings, self.plan,
            self.states, self.step,
        )  # fmt: skip
        if self.num_workers == 0:
            self._loader = iter(dataset)
        else:
            shutdown = self._shutdown = multiprocessing.get_context().Event()
            _SHUTDOWNS.append(shutdown)
            loader = torch.utils.data.DataLoader(
                dataset,
                batch_size=None,
                num_workers=self.num_workers,
                worker_init_fn=functools.partial(worker_init, shutdown),
                prefetch_factor=2,
            )
            self._loader = iter(loader)
        self._queues = {(r, s): deque() for r in self.plan.mine for s in range(len(self.sources))}

    # state ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's readers' positions after the last complete step (merge all ranks'
        with `merge_states` to move to another layout)."""
        return {
            "layout": dict(self.layout),
            "step": self.step,
            "epochs": list(self.epochs),
            "readers": {r: dict(states) for r, states in self.states.items()},
            "finished": {r: sorted(f) for r, f in self.finished.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state (one rank's or merged); needs this rank's readers."""
        saved = state.get("layout", {})
        for key, value in self.layout.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"data state was saved with {key}={saved.get(key)!r}, this run has "
                    f"{key}={value!r}: the stream cannot continue exactly"
                )
        missing = [r for r in self.plan.mine if r not in state["readers"]]
        if missing:
            raise ValueError(f"the data state has no position for readers {missing[:8]}")
        self.step, self.epochs = state["step"], list(state["epochs"])
        self.states = {r: dict(state["readers"][r]) for r in self.plan.mine}
        self.finished = {r: set(state["finished"].get(r, ())) for r in self.plan.mine}
        self.close()  # the next step starts workers at these positions

    def stats(self) -> dict[str, float]:
        """Data health over all ranks as of the last step: per source rows, documents,
        skipped (by reason), tokens and epoch, as 'data/<source>/<count>'."""
        return dict(self.health)


def merge_states(states: Sequence[dict]) -> dict:
    """One data state from the states of several ranks (each holds its own readers)."""
    merged = dict(states[0])
    merged["readers"], merged["finished"] = {}, {}
    for state in states:
        merged["readers"].update(state["readers"])
        merged["finished"].update(state["finished"])
    return merged
