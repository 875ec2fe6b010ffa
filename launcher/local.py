"""`belief-lm launch local`: the ranks of one machine, started and watched by this process.

Each rank is `belief-lm train` with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so it finds its peers exactly as under
torchrun. torchrun itself is not used because of how it ends: it exits 1 whenever a rank
exits non-zero, which hides a rank's "checkpointed, run me again" (exit_codes.PREEMPTED)
from whatever requeues the job, and a SIGUSR1 kills it while its ranks, in sessions of their
own, train on as orphans. Here:
- a stop signal (SIGTERM, SIGUSR1, SIGINT) reaching this process is passed to every rank;
  the ranks save the same step and exit 75, and so does this command;
- a rank that fails (any other exit) stops the others, which would otherwise wait for it in
  a collective until the process-group timeout: SIGTERM, then SIGKILL after STOP_GRACE_S;
  its exit code is this command's;
- the ranks get SIGTERM if this process dies, however it dies (PR_SET_PDEATHSIG): they save
  and exit, and never outlive their launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from belief_lm.config import Config

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOP_GRACE_S = 60
"""Seconds the other ranks get to end after one failed, before they are killed."""
PREEMPTED = 75
"""A rank's exit after saving on a stop signal (belief_lm.exit_codes.PREEMPTED; not imported
from there: job submission reads only the config)."""
PR_SET_PDEATHSIG = 1


def rank_commands(cfg: Config, train_args: list[str], port: int) -> list[tuple[dict, list[str]]]:
    """(environment variables, command line) of every rank of `belief-lm train <train_args>`
    on this machine, meeting at 127.0.0.1:`port`."""
    if cfg.launch.nodes != 1:
        raise ValueError(
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


def run(cfg: Config, train_args: list[str], port: int) -> int:
    """Start the ranks (meeting at local `port`), pass stop signals on, and return the
    job's exit code: a failed rank's code, else PREEMPTED if any rank stopped on request,
    else 0."""
    launcher = os.getpid()
    ranks = [
        subprocess.Popen(command, env={**os.environ, **env}, preexec_fn=_die_with(launcher))
        for env, command in rank_commands(cfg, train_args, port)
    ]

    def pass_on(signum, frame):
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, pass_on)
    failed, failed_at = None, 0.0
    while any(rank.poll() is None for rank in ranks):
        if failed is None:
            failed = _first_failure(ranks)
            if failed is not None:  # the others wait for it in a collective: end them
                failed_at = time.monotonic()
                pass_on(signal.SIGTERM, None)
        elif time.monotonic() - failed_at > STOP_GRACE_S:
            pass_on(signal.SIGKILL, None)
        time.sleep(0.1)
    for sig in STOP_SIGNALS:  # the ranks have ended: a late repeat must not kill this one
        signal.signal(sig, signal.SIG_IGN)
    if failed is None:
        failed = _first_failure(ranks)
    if failed is not None:
        return failed
    return PREEMPTED if PREEMPTED in [_exit_code(rank) for rank in ranks] else 0


def _first_failure(ranks: list[subprocess.Popen]) -> int | None:
    """The exit code of the first rank (in rank order) that ended other than with 0 or
    PREEMPTED; None if none did (yet)."""
    codes = (_exit_code(rank) for rank in ranks)
    return next((code for code in codes if code not in (None, 0, PREEMPTED)), None)


def _exit_code(rank: subprocess.Popen) -> int | None:
    """The rank's exit code as a shell reports it (128 + N when killed by signal N)."""
    code = rank.poll()
    return 128 - code if code is not None and code < 0 else code


def _die_with(parent: int):
    """A pre-exec hook: the child gets SIGTERM when `parent` dies (Linux)."""

    def set_parent_death_signal() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_parent_death_signal
