"""Stop requests: SIGTERM / SIGUSR1 (SLURM's preemption warning, `scancel -s USR1`,
torchrun forwarding SIGTERM) ask the run to finish its step, save and exit."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class Preempted(Exception):  # a normal outcome (exit_codes.PREEMPTED), not an error
    """Raised after the checkpoint of a stop request is saved."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after step {step}; checkpoint saved")
        self.step = step


class StopRequests:
    """Catches the stop signals while active; `agreed()` tells every rank whether any rank
    received one (a signal may reach only some ranks)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}
        self._group = None

    def __enter__(self) -> StopRequests:
        if dist.is_initialized():  # collective: every rank enters at the same point
            self._group = dist.new_group(backend="gloo")  # host-side flag, any main backend
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self) -> bool:
        """True on every rank if any rank received a stop signal (one all-reduce)."""
        flag = torch.tensor(0 if self.received is None else 1, dtype=torch.int32)
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag)
