"""Writing one rank's checkpoint files, checksummed, now or in the background.

DeepSpeed's engine writes every file of a checkpoint through its checkpoint engine
(`engine.checkpoint_engine.save(state, path)`; `deepspeed.runtime.checkpoint_engine`).
`CheckpointWriter` is belief-lm's, put in place by `install`:
- every file is recorded with its size and CRC-32, computed from the bytes on their way
  to the file (no second read), and synced to disk before it counts as written;
- every file is read back weights-only (`load`: loading.py), never with plain pickle;
- a writer made with `background=True` may write a checkpoint's files in the background:
  each save says whether it does (`saving(background=...)`, around DeepSpeed's save). Then
  `save` copies the state to host memory and returns; one thread writes the copies in
  order while training goes on, and `join` waits for them. The copy is the only pause
  training takes: device to (pinned) host memory on a GPU, a memory copy on a CPU, into
  buffers kept from the previous save (`HostStaging`).
DeepSpeed's own asynchronous engines do not fit here: the decoupled and fast writers need
its compiled async-I/O ops (not built on a CPU install), Nebula and DataStates external
services; torch's async `dcp.async_save` writes another format than the one every tool
of belief-lm reads (consolidate.py, universal.py).
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from belief_lm.checkpoint import loading
from belief_lm.checkpoint.manifest import ChecksummingFile, FileRecord

HOLD_ENV = "BELIEF_LM_TEST_HOLD_WRITES"
"""Test hook: a directory. A background write of checkpoint step_N, after its first file,
waits while `<directory>/step_N` exists (every rank) or `<directory>/step_N-rank<R>` (rank
R, as torchrun numbers it), so a test can signal or kill a run in the middle of a
background write, or hold one rank back (tests/checkpoint/test_async_save.py). Unset: no
effect."""


class CheckpointWriter(CheckpointEngine):
    """DeepSpeed's checkpoint engine for belief-lm (see the module docstring). `records`
    are the files written since the last `take_records`, by path."""

    def __init__(self, background: bool = False, trust: bool = False):
        super().__init__()
        self.name = "belief-lm"
        self.background = background
        """Whether this writer can write in the background (a thread of its own)."""
        self.trust = trust
        """Whether `load` reads a file beyond what a checkpoint may hold with pickle
        (loading.load; checkpoint.trust)."""
        self._in_background = False
        """Whether the files of the save in progress go to the background (`saving`)."""
        self.records: dict[Path, FileRecord] = {}
        self.cpu_seconds = 0.0
        """CPU time the writes took, in all (what a background write takes from the host)."""
        self._pool = None
        if background:
            self._pool = ThreadPoolExecutor(1, "checkpoint-writer", initializer=_yield_to_training)
        self._queued: list[Future] = []
        hold = os.environ.get(HOLD_ENV)
        self._hold = Path(hold) if hold else None
        self._started: set[str] = set()  # checkpoints whose first file was written (hook)
        self._staging = HostStaging()

    @contextlib.contextmanager
    def saving(self, background: bool) -> Iterator[None]:
        """Write the files saved inside (DeepSpeed's save_checkpoint, then ours) in the
        background if `background`, else at once (a save about to be waited for: no host
        copy needed)."""
        if background and self._pool is None:
            raise ValueError("this checkpoint writer was made without background=True")
        self._in_background = background
        try:
            yield
        finally:
            self._in_background = False

    # DeepSpeed's interface
    def create(self, info) -> None:
        pass

    def save(self, state_dict, path: str) -> None:
        if not self._in_background:
            self._write(Path(path), state_dict)
            return
        # The host copy is taken now (training may change the state as soon as this returns)
        snapshot = self._staging.copy(state_dict)
        self._queued.append(self._pool.submit(self._write, Path(path), snapshot, True))

    def load(self, path: str, map_location=None):
        return loading.load(path, map_location, trust=self.trust)  # weights-only

    def commit(self, info) -> bool:
        return True  # publication is store.py's, once every rank's files are written

    def preserves_storage_sharing(self) -> bool:
        # True: DeepSpeed clones a tensor viewing a larger buffer (pipeline layer files) so
        # the file holds the tensor, not the buffer. In the background, HostStaging does that.
        return not self._in_background

    # belief-lm's
    def done(self) -> bool:
        """Whether every queued write has ended (written or failed)."""
        return all(future.done() for future in self._queued)

    def join(self) -> BaseException | None:
        """Wait for every queued write; the first one's failure, if any failed."""
        failure = None
        for future in self._queued:
            error = future.exception()
            failure = failure or error
        return failure

    def failure(self) -> BaseException | None:
        """The first failure among the writes that ended (None: none failed yet)."""
        for future in self._queued:
            if future.done() and future.exception() is not None:
                return future.exception()
        return None

    def take_records(self) -> dict[Path, FileRecord]:
        """The records of the files written since the last call, once every queued write
        has ended (`done`); their host copies then serve the next save."""
        records, self.records = self.records, {}
        self._queued = []
        self._staging.recycle()
        return records

    def _write(self, path: Path, state, in_background: bool = False) -> None:
        if in_background:
            self._wait_if_held(path)
        started = time.thread_time()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            out = ChecksummingFile(file)
            torch.save(state, out)
            file.flush()
            os.fsync(file.fileno())  # written means on disk: the manifest will vouch for it
        self.records[path] = out.record()
        self.cpu_seconds += time.thread_time() - started

    def _wait_if_held(self, path: Path) -> None:
        if self._hold is None:
            return
        tmp = next((part for part in path.parts if part.startswith(".tmp-")), None)
        if tmp is None:
            return
        name = tmp.removeprefix(".tmp-")
        if name not in self._started:
            self._started.add(name)  # its first file is written at once
            return
        rank = os.environ.get("RANK", "0")
        while (self._hold / name).exists() or (self._hold / f"{name}-rank{rank}").exists():
            time.sleep(0.05)


WRITER_NICENESS = 10
"""How much lower the writer thread's scheduling priority is than training's: where the
host's cores are all busy (a CPU run, busy loader workers) training gets them first and
the write takes longer; where cores are free it changes nothing."""


def _yield_to_training() -> None:
    # Linux schedules threads as tasks of their own: this one alone is reniced (elsewhere,
    # or where it is not allowed, the writer keeps the default priority)
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)


class HostStaging:
    """Host memory for the copies background saves take, kept from one save to the next: a
    save copies into the buffers of the one before (the shapes are the same every time), so
    it pays no page faults (the kernel zeroes fresh memory as it is first touched) and, on a
    GPU, no pinned allocation. The price: one copy of the rank's checkpoint state stays in
    host memory between saves."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        self._in_use: list[torch.Tensor] = []

    def copy(self, state):
        """A copy of `state` (nested dicts, lists, tuples) whose tensors are copies in host
        memory, each holding only its own elements (a view of a larger buffer is copied
        compactly, as DeepSpeed's clone_tensors_for_torch_save does); a tensor appearing
        twice is copied once. Other values are deep-copied."""
        memo: dict[int, object] = {}
        copied = self._copy(state, memo)
        if any(t.is_pinned() for t in self._in_use):
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return copied

    def recycle(self) -> None:
        """The copies taken so far are written: their buffers serve the next save."""
        for buffer in self._in_use:
            self._free[(buffer.shape, buffer.dtype)].append(buffer)
        self._in_use = []

    def _buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        free = self._free[(tensor.shape, tensor.dtype)]
        if free:
            buffer = free.pop()
        else:  # pinned host memory for a device tensor: the copy runs async, at full speed
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        self._in_use.append(buffer)
        return buffer

    def _copy(self, value, memo: dict[int, object]):
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            result = self._buffer(tensor)
            result.copy_(tensor, non_blocking=tensor.is_cuda)
        elif isinstance(value, dict):
            result = value.copy()  # keeps the type (OrderedDict, defaultdict)
            for key in result:
                result[key] = self._copy(value[key], memo)
        elif isinstance(value, list):
            result = [self._copy(item, memo) for item in value]
        elif isinstance(value, tuple):
            items = [self._copy(item, memo) for item in value]
            # a namedtuple takes its fields, another tuple subclass (torch.Size) an iterable
            result = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        else:
            result = copy.deepcopy(value)
        memo[id(value)] = result
        return result


def install(engine, writer: CheckpointWriter) -> None:
    """Make `writer` the checkpoint engine of DeepSpeed engine `engine` (before its first
    save or load). DeepSpeed builds its engine's checkpoint engine from the config and has
    no argument for one of our own; `checkpoint_engine` is the public attribute its
    save_checkpoint and load_checkpoint use (and its own engines replace)."""
    if not isinstance(getattr(engine, "checkpoint_engine", None), CheckpointEngine):
        raise RuntimeError(
            "this DeepSpeed engine has no `checkpoint_engine` (CheckpointEngine): belief-lm "
            "writes checkpoints through it; check the DeepSpeed version"
        )
    engine.checkpoint_engine = writer
