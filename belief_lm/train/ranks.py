"""Slow ranks: how long each rank computes per step, and the spread over the job.

Collectives make every rank's wall-clock step equally long (the fast ranks wait inside
them for the slowest), so step times cannot show a straggler. The time a rank spends in
its own model forward passes can: `ForwardTimer` adds it up from hooks on the model (CUDA
events on a GPU, where the host only queues the work), and at each log `rank_spread`
gathers every rank's seconds per step (one small all-gather) into the min, median and
max over the ranks and the rank with the most.

What the forward passes include besides this rank's own arithmetic: the tensor-parallel
all-reduces inside the layers (a slow rank slows its tensor-parallel peers too, so the
group shows, the slowest of it named), and under ZeRO-3 the parameter gathers. Pipeline
stages differ by design (embedding, output layer): compare ranks of one stage.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from belief_lm.parallel.collectives import collective_device


class ForwardTimer:
    """Seconds this rank spends in `module`'s forward passes while `measuring()`
    (training steps, not validation or diagnostics)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.active = False
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._started: float | torch.cuda.Event | None = None
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    @contextmanager
    def measuring(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _start(self, module, args) -> None:
        if not self.active:
            return
        if self.cuda:
            self._started = torch.cuda.Event(enable_timing=True)
            self._started.record()
        else:
            self._started = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        if not self.active or self._started is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started, end))
        else:
            self.seconds += time.perf_counter() - self._started
        self._started = None

    def take(self) -> float:
        """The seconds measured since the last take (on a GPU this waits for the last
        forward pass to finish: a host-device sync, once per log interval)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1e3
            self._events.clear()
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def rank_spread(seconds: float) -> dict[str, float]:
    """min / median / max of `seconds` over all ranks, and the rank with the most, as
    `ranks/forward_s_*` and `ranks/slowest` (collective: one all-gather of one number)."""
    mine = torch.tensor([seconds], dtype=torch.float64, device=collective_device())
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    values = torch.cat(every).tolist()
    slowest = max(range(len(values)), key=values.__getitem__)
    return {
        "ranks/forward_s_min": min(values),
        "ranks/forward_s_median": statistics.median(values),
        "ranks/forward_s_max": values[slowest],
        "ranks/slowest": float(slowest),
    }
