"""Stop requests: SIGTERM, SIGUSR1 and SIGINT ask the run to finish its step, save and exit
with exit_codes.PREEMPTED, however they are delivered.

Clusters deliver them in many ways: SLURM's time-limit warning (`--signal`), preemption and
`scancel` signal the batch shell, srun or every process of the job; torchrun and `launch
local` forward what they receive; a terminal's Ctrl-C signals the whole foreground process
group. Any subset of the ranks may get one, several times. So a signal only sets a flag
(a repeat while saving changes nothing), and after every step the ranks agree whether any
of them got one. Loader workers pass them on to their trainer and read on
(data_pipeline.loader.worker_init): the trainer stops them once it has saved.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (torch-free at run time)
    from belief_lm.parallel.grid import ProcessGrid

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequests:
    """Catches the stop signals while active; `agreed(grid)` tells every rank whether any
    rank received one. Torch-free, so the `train` command catches signals from its first
    moment (a stop during start-up is honoured after the first step)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def catch(self) -> StopRequests:
        """Catch the stop signals from now on (until `__exit__`, if used as a context)."""
        for sig in STOP_SIGNALS:
            self._previous.setdefault(sig, signal.signal(sig, self._handle))
        return self

    def ignore_from_now(self) -> None:
        """Ignore stop signals from here to the end of the process: the run is over (saved, if
        it was asked to stop), and a late repeat of a signal must not turn the exit code into
        a death by that signal (Python restores the default action, which for these is to
        terminate, when the interpreter shuts down)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def __enter__(self) -> StopRequests:
        return self.catch()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            name = signal.Signals(signum).name
            os.write(2, f"belief-lm: {name}: finishing the step, then saving\n".encode())

    def agreed(self, grid: ProcessGrid) -> bool:
        """True on every rank if any rank received a stop signal (one all-reduce of a flag
        on the grid's stop-request group; collective: every rank calls it at the same point
        of the loop)."""
        return grid.any_rank(self.received is not None)
