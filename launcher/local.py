"""`belief-lm launch local`: the ranks of one machine, started and watched by this process.

Each rank is `belief-lm train` with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so it finds its peers exactly as under
torchrun. torchrun itself is not used because of how it ends: it exits 1 whenever a rank
exits non-zero, which hides a rank's "checkpointed, run me again" (exit_codes.PREEMPTED)
from whatever requeues the job, and a SIGUSR1 kills it while its ranks, in sessions of their
own, train on as orphans. Here:
- a stop signal (SIGTERM, SIGUSR1, SIGINT) reaching this process is passed to every rank;
  the ranks save the same step and exit 75, and so does this command;
- each rank leads a process group of its own, with its loader workers: a rank that dies
  leaves them behind, holding copies of its sockets, so its peers would not see its
  connections close until the workers noticed (seconds); the group is killed at once;
- a rank that fails (any other exit) ends the others, which cannot go on without it: one
  line names it (rank, pid, host, exit code or signal) unless it said itself what happened
  (exit_codes.PEER_LOST: it names the silent ranks, which are killed at once); the others,
  whose collectives fail at once, exit quietly with PEER_LOST (belief_lm.parallel.peers).
  A stopped rank is continued so that it can end; any rank still there after QUIET_S gets
  SIGTERM, after STOP_GRACE_S SIGKILL. The failed rank's exit code is this command's;
- with launch.failure_restarts=N, a failure other than bad input (2), loss spikes (3, a
  person's call) or a stop (75), the ends of exit_codes.NOT_RESTARTED, starts the ranks
  again, up to N times, on a new port: they resume from the newest checkpoint, and the
  restart's cause goes to starts.jsonl (the ranks read it from RESTART_VARIABLE);
- the ranks get SIGTERM if this process dies, however it dies (PR_SET_PDEATHSIG): they save
  and exit, and never outlive their launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from belief_lm.config import ConfigError
from belief_lm.exit_codes import DONE, NOT_RESTARTED, PEER_LOST, PREEMPTED

if TYPE_CHECKING:
    from belief_lm.config import Config

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
QUIET_S = 5
"""Seconds the other ranks get to end on their own after one failed (their collectives fail
at once) before they are asked to stop: a stop would make each say so."""
STOP_GRACE_S = 30
"""Seconds after one failed until the ranks still running are killed."""
RESTART_VARIABLE = "BELIEF_LM_RESTART"
"""The restart's cause (JSON) for the ranks to record in starts.jsonl
(belief_lm.train.run_dir.RESTART_VARIABLE)."""
HEARTBEATS = "heartbeats"
"""The ranks' heartbeat directory in the run directory (belief_lm.parallel.heartbeat), where
a rank that found a silent peer leaves its report (peer_lost.*.json)."""
PR_SET_PDEATHSIG = 1


def rank_commands(cfg: Config, train_args: list[str], port: int) -> list[tuple[dict, list[str]]]:
    """(environment variables, command line) of every rank of `belief-lm train <train_args>`
    on this machine, meeting at 127.0.0.1:`port`."""
    if cfg.launch.nodes != 1:
        raise ConfigError(
            f"launch.nodes is {cfg.launch.nodes}, but launch local runs on this machine "
            "only (use launch slurm for several nodes)"
        )
    ranks = cfg.launch.tasks
    # this environment's belief-lm, whatever PATH says
    command = [sys.executable, "-m", "belief_lm.cli", "train", *train_args]
    shared = {"WORLD_SIZE": ranks, "LOCAL_WORLD_SIZE": ranks, "MASTER_ADDR": "127.0.0.1"}
    shared["MASTER_PORT"] = port
    return [
        ({k: str(v) for k, v in {**shared, "RANK": r, "LOCAL_RANK": r}.items()}, command)
        for r in range(ranks)
    ]


@dataclass
class Failure:
    """The rank whose end ended a run of the ranks."""

    rank: int
    pid: int
    code: int
    """Its exit code as a shell reports it (128 + N for signal N)."""

    def record(self, run_dir: Path, since: float) -> dict:
        """The restart's cause, as starts.jsonl keeps it."""
        record = {"rank": self.rank, "host": socket.gethostname()}
        if self.code > 128:
            record.update(cause="rank died", signal=_signal_name(self.code - 128))
        else:
            record.update(cause="rank failed", exit_code=self.code)
        if self.code == PEER_LOST:
            record["cause"] = "peer lost"
            report = _peer_report(run_dir, since)
            if report is not None:  # the rank that found a silent peer named it
                record["silent"] = report.get("silent", [])
        return record

    def line(self) -> str:
        """'belief-lm: rank 1 (pid 4242 on host h) was killed by SIGKILL'."""
        where = f"rank {self.rank} (pid {self.pid} on {socket.gethostname()})"
        if self.code > 128:
            return f"belief-lm: {where} was killed by {_signal_name(self.code - 128)}"
        return f"belief-lm: {where} exited with {self.code}"


def run(cfg: Config, train_args: list[str], free_port: Callable[[], int]) -> int:
    """Start the ranks (meeting at a local port from `free_port`), pass stop signals on,
    restart them in place after a failure (launch.failure_restarts), and return the job's
    exit code: a failed rank's code, else PREEMPTED if any rank stopped on request, else 0."""
    ranks: list[subprocess.Popen] = []
    stopped = []  # the stop signals this process received

    def pass_on(signum, frame):
        stopped.append(signum)
        _signal_all(ranks, signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    restarts, restart = 0, None
    run_dir = Path(cfg.run.output_dir).expanduser()
    while True:
        started = time.time()
        env = {} if restart is None else {RESTART_VARIABLE: json.dumps(restart)}
        ranks[:] = _start(rank_commands(cfg, train_args, free_port()), env)
        code, failure = _watch(ranks, run_dir, started, cfg.parallel.timeout_s)
        if failure is None or code in NOT_RESTARTED or stopped:
            break
        if restarts >= cfg.launch.failure_restarts:
            break
        time.sleep(1)  # a stop signal that came with the failure (a scancel, a Ctrl-C)
        if stopped:
            break
        restarts += 1
        restart = {"restart": restarts, "of": cfg.launch.failure_restarts}
        restart.update(failure.record(run_dir, started))
        print(
            f"belief-lm: restarting the {len(ranks)} ranks from the newest checkpoint "
            f"(failure restart {restarts} of {cfg.launch.failure_restarts})",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    for sig in STOP_SIGNALS:  # the ranks have ended: a late repeat must not kill this one
        signal.signal(sig, signal.SIG_IGN)
    return code


def _start(commands: list[tuple[dict, list[str]]], env: dict) -> list[subprocess.Popen]:
    launcher = os.getpid()
    return [
        subprocess.Popen(
            command,
            env={**os.environ, **env, **rank_env},
            preexec_fn=_die_with(launcher),
            process_group=0,
        )
        for rank_env, command in commands
    ]


def _watch(
    ranks: list[subprocess.Popen], run_dir: Path, since: float, timeout_s: float
) -> tuple[int, Failure | None]:
    """Wait for the ranks (started at `since`) to end, ending the others once one fails;
    (the job's exit code, the failure that ended it or None)."""
    failure, failed_at, asked = None, 0.0, False
    while True:
        running = any(rank.poll() is None for rank in ranks)
        if failure is None:
            failure = _first_failure(ranks)
            if failure is not None:  # the others cannot go on without it: end them
                failed_at = time.monotonic()
                _kill_group(ranks[failure.rank])  # its loader workers hold its sockets open
                _report(failure, run_dir, since, len(ranks), timeout_s)
                for silent in _named_silent(failure, run_dir, since, len(ranks)):
                    _kill_group(ranks[silent])  # it cannot save without its peers either
                _signal_all(ranks, signal.SIGCONT)  # a stopped rank can end only if continued
        if not running:
            break
        if failure is not None and not asked and time.monotonic() - failed_at > QUIET_S:
            asked = True
            _signal_all(ranks, signal.SIGTERM)
        elif failure is not None and time.monotonic() - failed_at > STOP_GRACE_S:
            _signal_all(ranks, signal.SIGKILL)
        time.sleep(0.1)
    for rank in ranks:  # whatever a rank left behind (none after a clean end)
        _kill_group(rank)
    if failure is not None:
        return failure.code, failure
    return PREEMPTED if PREEMPTED in [_exit_code(rank) for rank in ranks] else DONE, None


def _report(failure: Failure, run_dir: Path, since: float, world: int, timeout_s: float) -> None:
    """The failure's one line, unless the rank that failed said what happened itself (it
    found a silent peer), with the ranks whose heartbeat stopped more than half the
    collective timeout ago: on NCCL, torch's watchdog ends the ranks that waited for a
    silent one (SIGABRT), and this names the silent one."""
    if failure.code == PEER_LOST and _peer_report(run_dir, since) is not None:
        return
    line = failure.line()
    now, silent = time.time(), []
    for rank in range(world):
        try:
            beat = json.loads((run_dir / HEARTBEATS / f"rank_{rank:05d}.json").read_text())
            age = now - beat["time"]
            if rank != failure.rank and beat["started"] >= since and age > timeout_s / 2:
                silent.append(f"rank {rank} (pid {beat['pid']} on {beat['host']}, no "
                              f"heartbeat for {age:.0f} s)")  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError):  # none, or no heartbeat of ours
            continue
    if silent:
        line += "; silent: " + ", ".join(silent)
    print(line, file=sys.stderr, flush=True)


def _first_failure(ranks: list[subprocess.Popen]) -> Failure | None:
    """The rank that ended other than with 0 or PREEMPTED, if any has: one that was not
    merely left without a peer (PEER_LOST) first, then the lowest rank."""
    failed = [
        Failure(rank, process.pid, code)
        for rank, process in enumerate(ranks)
        if (code := _exit_code(process)) not in (None, DONE, PREEMPTED)
    ]
    failed.sort(key=lambda failure: failure.code == PEER_LOST)  # stable: rank order stays
    return failed[0] if failed else None


def _signal_all(ranks: list[subprocess.Popen], signum: int) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signum)


def _named_silent(failure: Failure, run_dir: Path, since: float, world: int) -> list[int]:
    """The ranks that the rank which found a silent peer named (none for other failures)."""
    report = _peer_report(run_dir, since) if failure.code == PEER_LOST else None
    silent = report.get("silent", []) if report else []
    return [rank for rank in silent if isinstance(rank, int) and 0 <= rank < world]


def _kill_group(rank: subprocess.Popen) -> None:
    """SIGKILL the rank's process group: the rank, if it still runs, and its loader
    workers."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(rank.pid, signal.SIGKILL)


def _exit_code(rank: subprocess.Popen) -> int | None:
    """The rank's exit code as a shell reports it (128 + N when killed by signal N)."""
    code = rank.poll()
    return 128 - code if code is not None and code < 0 else code


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _peer_report(run_dir: Path, since: float) -> dict | None:
    """The report a rank of this run left on finding a silent peer, if any."""
    reports = [
        path for path in (run_dir / HEARTBEATS).glob("peer_lost.*.json")
        if path.stat().st_mtime >= since
    ]  # fmt: skip
    if not reports:
        return None
    try:
        report = json.loads(max(reports, key=lambda p: p.stat().st_mtime).read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None  # else not a report of ours


def _die_with(parent: int):
    """A pre-exec hook: the child gets SIGTERM when `parent` dies (Linux)."""

    def set_parent_death_signal() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal
