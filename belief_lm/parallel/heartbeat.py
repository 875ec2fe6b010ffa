"""Per-rank heartbeats: each rank of a training job rewrites a small file in the run
directory every few seconds from a background thread, so that a rank whose collective
timed out can tell which peers are silent (a stopped, frozen or vanished process stops
beating; one that is merely busy or waiting elsewhere does not).

Files, not the rendezvous store: the store lives in rank 0's process, and a client's
request to a stopped rank 0 waits far past its timeout (torch 2.13), so the store cannot
tell on the rank that holds it. The run directory is on a file system every rank shares
(checkpoints need it), a launcher or a person can read the files without torch, and at
one small write per rank every `interval` seconds (at most 10) a large job's rate stays
far below what a shared file system serves. Ages compare the writer's clock with the
reader's: the hosts' clocks must agree to within a second or so (NTP).

    heartbeats/rank_00001.json   {"rank": 1, "host": "gpu07", "pid": 4242, "step": 310,
                                  "time": 1767225600.5, "started": 1767225400.1}
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

DIRECTORY = "heartbeats"
"""Where in the run directory the heartbeat files are."""


def interval_for(timeout_s: float) -> float:
    """Seconds between beats for a collective timeout: a tenth of it (silence is judged
    at 3 intervals, well inside the timeout), between 0.5 and 10."""
    return min(max(timeout_s / 10, 0.5), 10.0)


@dataclass(frozen=True)
class Beat:
    """A rank's last heartbeat."""

    rank: int
    host: str
    pid: int
    step: int
    """Optimizer steps this rank had completed."""
    time: float
    """When it was written (the writer's wall clock, seconds since the epoch)."""
    started: float
    """When this rank's process started beating."""

    def age(self, now: float | None = None) -> float:
        """Seconds since this beat was written."""
        return (time.time() if now is None else now) - self.time

    def describe(self, now: float | None = None) -> str:
        """'rank 1 (host h, pid 42; last heartbeat 14 s ago, at step 3)'."""
        return (
            f"rank {self.rank} (host {self.host}, pid {self.pid}; last heartbeat "
            f"{self.age(now):.0f} s ago, at step {self.step})"
        )


class Heartbeat:
    """This rank's heartbeat: a daemon thread rewriting `run_dir/heartbeats/rank_R.json`
    every `interval` seconds with the step set in `step`."""

    def __init__(self, run_dir: str | Path, rank: int, interval: float):
        self.directory = Path(run_dir).expanduser() / DIRECTORY
        self.rank = rank
        self.interval = interval
        self.step = 0
        """The optimizer steps done (the training loop sets it)."""
        self._started = time.time()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Write the first beat now (so a reader sees this rank at once), then keep beating."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=self.interval + 5)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            # a full or briefly unreachable file system: beat again later
            with contextlib.suppress(OSError):
                self._write()

    def _write(self) -> None:
        beat = Beat(
            rank=self.rank, host=socket.gethostname(), pid=os.getpid(), step=self.step,
            time=time.time(), started=self._started,
        )  # fmt: skip
        path = path_of(self.directory.parent, self.rank)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps(asdict(beat)))
        os.replace(staged, path)  # readers never see half a file


def path_of(run_dir: str | Path, rank: int) -> Path:
    """The heartbeat file of `rank`."""
    return Path(run_dir).expanduser() / DIRECTORY / f"rank_{rank:05d}.json"


def read(run_dir: str | Path, ranks: list[int]) -> dict[int, Beat | None]:
    """The last beat of each of `ranks` (None: no readable heartbeat file)."""
    beats = {}
    for rank in ranks:
        try:
            beats[rank] = _checked(Beat(**json.loads(path_of(run_dir, rank).read_text())))
        except (OSError, ValueError, TypeError):
            beats[rank] = None
    return beats


def _checked(beat: Beat) -> Beat:
    """`beat` if each field has its type (TypeError if not: a file that is no heartbeat)."""
    for item in fields(Beat):
        kind = {"int": int, "float": int | float, "str": str}[item.type]
        value = getattr(beat, item.name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError(f"{item.name}={value!r}")
    return beat


def silent(beats: dict[int, Beat | None], after_s: float) -> list[int]:
    """The ranks whose last beat is older than `after_s` seconds or missing (a file left
    by an earlier run of the job is old too, until the rank's new process beats)."""
    now = time.time()
    return [rank for rank, beat in beats.items() if beat is None or beat.age(now) > after_s]
