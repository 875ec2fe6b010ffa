"""A lost peer: what a rank does when a collective fails because another rank of the job
stopped answering (the collective timed out) or vanished (its connection closed).

Either way the job cannot go on (every later collective needs that rank, a checkpoint
too), so the rank exits with exit_codes.PEER_LOST, and quietly: the process that knows
what happened says it, in one line.
- A rank that died: its launcher knows its exit code or signal (`launch local`, srun,
  torchrun each print one line), so the survivors, whose collectives fail at once with
  "Connection closed by peer", print nothing.
- A rank that went silent (stopped, frozen, off the network): only a rank whose collective
  timed out knows. It reads the heartbeats (belief_lm.parallel.heartbeat) of the
  collective's group and names the silent ones, and the collective and its caller. Several
  ranks may time out at once (each waits for the silent rank or for one that waits for
  it): the first to create `heartbeats/peer_lost.<run>.json` prints the line (and leaves
  it there as JSON, for launchers and people), the others stay quiet.

A job's ranks agree on a run token when the watch starts, so a restarted job reports its
own faults, not an earlier run's. What a process knows of its peers (the roles of the
groups, the watch over the heartbeats) is a `Peers`, owned by the process grid
(belief_lm.parallel.grid).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from belief_lm import compat
from belief_lm.errors import PeerLost
from belief_lm.parallel import heartbeat

TIMED_OUT = re.compile(r"timed out|timeout", re.I)
"""gloo: 'Timed out waiting 10000ms for recv operation'; NCCL: 'Watchdog caught collective
operation timeout'."""
VANISHED = re.compile(
    r"connection (closed|reset) by peer|broken pipe|connection refused|remote worker crash"
    r"|remote process exited|communicator was aborted",
    re.I,
)
"""A peer's end of the connection is gone (gloo, NCCL)."""
BACKEND = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.I)
"""A message from a communication backend (an exception raised outside a collective's own
frame: a Work.wait() of an asynchronous collective)."""
WRAPPERS = re.compile(r"deepspeed/comm/|deepspeed/utils/nvtx|typing_extensions|/contextlib\.py")
"""Code that only passes a collective on (its caller is the one to name): DeepSpeed's
communication layer, decorators."""
STALE_INTERVALS = 3
"""A rank is silent when its heartbeat is this many intervals old."""
SHOWN = 8
"""Silent ranks described one by one in the line; more are counted."""


@dataclass
class Watch:
    """This process's watch over its peers' heartbeats (started by `Peers.start_watch`)."""

    run_dir: Path
    timeout_s: float
    """parallel.timeout_s: how long a collective waits."""
    rank_zero_wait_s: float
    """parallel.rank_zero_wait_s: how long the others wait for rank 0's one-off work."""
    heartbeat: heartbeat.Heartbeat
    token: int
    """This run of the job (rank 0's start time in ms, the same on every rank)."""

    @property
    def silent_after_s(self) -> float:
        return STALE_INTERVALS * self.heartbeat.interval


def is_lost_peer(err: BaseException) -> bool:
    """Whether `err` is a collective's failure because of a peer (timed out, or a peer's
    connection closed)."""
    if isinstance(err, PeerLost):
        return True
    message = str(err)
    if not isinstance(err, RuntimeError) or not dist.is_initialized():
        return False  # (a rendezvous that timed out: its own message says which)
    if not (TIMED_OUT.search(message) or VANISHED.search(message)):
        return False
    if compat.failed_collective(err.__traceback__) is not None:
        return True
    # a backend's message outside a collective's frame (Work.wait()), not a timeout of
    # something else (a download, a subprocess)
    return isinstance(err, dist.DistError) or bool(BACKEND.search(message))


class Peers:
    """What this process knows of its peers: the roles of the process groups (for the line
    that names a timed-out collective's group) and, in a training run, the watch over their
    heartbeats. Owned by the process grid (belief_lm.parallel.grid), which names its groups
    here as it makes them and starts the watch."""

    def __init__(self) -> None:
        self.watch: Watch | None = None
        """The heartbeat watch (None outside a training run, and in a job of one process)."""
        self._roles: dict[int, tuple[dist.ProcessGroup, str]] = {}
        """Group roles by the group's id (each group kept alive with its role)."""

    def name(self, group: dist.ProcessGroup, role: str) -> dist.ProcessGroup:
        """Give `group` a role for the line that reports a timeout in it ('the stop-request
        group'); returns the group."""
        self._roles[id(group)] = (group, role)
        return group

    def role(self, group: dist.ProcessGroup | None) -> str:
        """The group's role: the world, a named one, else 'a group'."""
        if group is None or group is dist.group.WORLD:
            return "the world"
        named = self._roles.get(id(group))
        return named[1] if named is not None and named[0] is group else "a group"

    def start_watch(self, run_dir: str | Path, timeout_s: float, rank_zero_wait_s: float) -> None:
        """Start this rank's heartbeat in `run_dir` and agree on the run's token (collective:
        every rank calls it, once the process group is up); `timeout_s` is how long a
        collective waits (parallel.timeout_s), `rank_zero_wait_s` how long the others wait
        for rank 0's one-off work. A job of one process has no peers to watch."""
        self.stop()
        if dist.get_world_size() == 1:
            return
        # (NCCL broadcasts only CUDA tensors)
        device = None
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        token = torch.tensor([int(time.time() * 1000)], dtype=torch.int64, device=device)
        dist.broadcast(token, src=0)  # before any heartbeat: no report can race it
        beat = heartbeat.Heartbeat(run_dir, dist.get_rank(), heartbeat.interval_for(timeout_s))
        self.watch = Watch(Path(run_dir).expanduser(), timeout_s, rank_zero_wait_s, beat.start(),
                           int(token))  # fmt: skip

    def beat(self, step: int) -> None:
        """Tell the heartbeat the optimizer steps done so far."""
        if self.watch is not None:
            self.watch.heartbeat.step = step

    def stop(self) -> None:
        """Stop the heartbeat (the run is over)."""
        if self.watch is not None:
            self.watch.heartbeat.stop()
            self.watch = None

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Raise PeerLost for a collective that fails inside because of a peer (any other
        exception passes as it is); the heartbeat stops if anything fails."""
        try:
            yield
        except BaseException as err:
            try:  # diagnosed while the watch is up: its heartbeats name the silent ranks
                lost = self.diagnose(err) if isinstance(err, RuntimeError) else None
            finally:
                self.stop()
            if lost is None or lost is err:
                raise
            raise lost from err

    def diagnose(self, err: BaseException) -> PeerLost | None:
        """PeerLost for an exception from a collective that failed because of a peer, with
        the line to print if this rank is the one to report it; None for any other
        exception. (Reporting: call it once per failure.)"""
        if isinstance(err, PeerLost):
            return err
        if not is_lost_peer(err):
            return None
        found = compat.failed_collective(err.__traceback__)
        name, group, callers = found or ("a collective", None, [])
        what = self._describe(name, group, callers)
        if VANISHED.search(str(err)):
            return PeerLost(f"{what} failed: a peer's connection closed", line=None)
        return self.timed_out_in(what, group)

    def timed_out_in(
        self, what: str, group: dist.ProcessGroup | None, waited_s: float | None = None
    ) -> PeerLost:
        """PeerLost for `what` (a collective on `group`) having timed out, naming the
        group's silent ranks; its line is None unless this rank is the first to report."""
        rank = dist.get_rank()
        ranks = [r for r in dist.get_process_group_ranks(group or dist.group.WORLD) if r != rank]
        if waited_s is None:
            waited_s = compat.group_timeout(group).total_seconds()
        message = f"rank {rank}: {what} timed out after {waited_s:.0f} s"
        watch = self.watch
        if watch is None:  # no heartbeats to judge by
            message += f"; waiting for {ranks_phrase(ranks)}"
            return PeerLost(message, line=f"belief-lm: {message}")
        beats = heartbeat.read(watch.run_dir, ranks)
        silent = heartbeat.silent(beats, watch.silent_after_s)
        now = time.time()
        if silent:
            shown = [
                beats[r].describe(now) if beats[r] else f"rank {r} (no heartbeat)" for r in silent
            ]
            more = f" and {len(silent) - SHOWN} more" if len(silent) > SHOWN else ""
            message += f"; not arrived: {', '.join(shown[:SHOWN])}{more}"
        else:
            message += (
                f"; no rank of it is silent (heartbeats under {watch.silent_after_s:.0f} s "
                f"old): {ranks_phrase(ranks)} wait elsewhere"
            )
        line = f"belief-lm: {message}"
        report = {"rank": rank, "line": line, "silent": silent, "time": now}
        return PeerLost(message, line if first_to_report(watch, report) else None, silent)

    def wait_for_rank_zero(self, work: dist.Work, what: str) -> None:
        """Wait for `work` (an asynchronous collective that completes once rank 0 is done)
        for up to parallel.rank_zero_wait_s while rank 0's heartbeat goes on; a rank 0
        silent for parallel.timeout_s is lost. Without a watch, a plain wait (the group's
        timeout)."""
        watch = self.watch
        if watch is None or dist.get_rank() == 0:
            work.wait()
            return
        started = time.monotonic()
        poll = min(watch.heartbeat.interval, 1.0)
        while not work.is_completed():
            waited = time.monotonic() - started
            beats = heartbeat.read(watch.run_dir, [0])
            # no heartbeat yet: rank 0 may not have written its first (it starts beating as
            # the others do, not before them); silent only once a timeout has passed
            silent = [r for r in heartbeat.silent(beats, watch.timeout_s)
                      if beats[r] is not None or waited > watch.timeout_s]  # fmt: skip
            if silent:
                raise self.timed_out_in(what, None, waited)
            if waited > watch.rank_zero_wait_s:
                raise _too_long(what, waited, watch)
            time.sleep(poll)
        work.wait()  # raises what the collective met

    def _describe(self, name: str, group: dist.ProcessGroup | None, callers: list) -> str:
        """'all_reduce over the tensor-parallel group (ranks 0-1) in .../mappings.py:38
        _reduce': the collective and the code that called it (past communication wrappers)."""
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        callers = [f for f in callers if not WRAPPERS.search(f.f_code.co_filename)] or callers
        where = ""
        if callers:
            caller = callers[-1]
            path = "/".join(Path(caller.f_code.co_filename).parts[-3:])
            where = f" in {path}:{caller.f_lineno} {caller.f_code.co_name}"
        return f"{name} over {self.role(group)} ({ranks_phrase(ranks)}){where}"


def first_to_report(watch: Watch, report: dict) -> bool:
    """Whether this rank is the first of the run to report a timeout (it leaves the report
    in the heartbeat directory); True also where the file system cannot say."""
    path = watch.run_dir / heartbeat.DIRECTORY / f"peer_lost.{watch.token}.json"
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True
    with os.fdopen(descriptor, "w") as file:
        file.write(json.dumps(report) + "\n")
    return True


def _too_long(what: str, waited: float, watch: Watch) -> PeerLost:
    message = (
        f"rank {dist.get_rank()}: {what}: rank 0 is alive but did not finish within "
        f"parallel.rank_zero_wait_s={watch.rank_zero_wait_s:g} s"
    )
    report = {"rank": dist.get_rank(), "line": f"belief-lm: {message}", "silent": []}
    first = first_to_report(watch, report)
    return PeerLost(message, f"belief-lm: {message}" if first else None)


def ranks_phrase(ranks: list[int]) -> str:
    """'ranks 0-3, 8' (a large group stays one short phrase)."""
    if not ranks:
        return "no ranks"
    ranks = sorted(ranks)
    spans, first, previous = [], ranks[0], ranks[0]
    for rank in ranks[1:]:
        if rank != previous + 1:
            spans.append((first, previous))
            first = rank
        previous = rank
    spans.append((first, previous))
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def end_child_processes() -> None:
    """Kill this process's multiprocessing children (data loader workers): with a peer
    lost the step cannot finish, and a worker would take its loader's 5 s status interval
    to notice that its trainer is gone. torch's DataLoader would take a killed worker for
    a crash (its SIGCHLD handler raises): the default handling comes back first."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()
