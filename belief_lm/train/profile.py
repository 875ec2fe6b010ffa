"""Profiling a few training steps (run.profile.start_step, run.profile.steps).

Every rank records those steps with torch.profiler (CPU activity, and CUDA kernels on a
GPU), each step labelled `belief_lm.train_step#N`, and writes one Chrome trace per rank:
`run.output_dir/profile/rank<R>_steps<A>-<B>.pt.trace.json` (`rank<R>_step<A>` for one
step). Open it in Perfetto (ui.perfetto.dev) or chrome://tracing, or point TensorBoard's
profiler plugin (torch-tb-profiler) at the profile directory.

On a GPU the CUDA caching allocator's history is also recorded over the first profiled
step and dumped as `profile/memory_rank<R>_step<A>.pickle` (drop it on
pytorch.org/memory_viz). That part uses torch's private torch.cuda.memory API
(belief_lm.compat's record_memory_history / dump_memory_history), guarded by the device
type; its calls are tested on the CPU with stand-ins, and for real by a GPU-marked test
(tests/train/test_profile.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from belief_lm import compat
from belief_lm.config import ProfileConfig

log = logging.getLogger("belief_lm.train")

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept for the memory snapshot (the newest; one step fits easily)."""


class StepProfiler:
    """Wraps each training step; records the configured ones."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, device: torch.device, rank: int):
        self.first = cfg.start_step
        self.last = None if cfg.start_step is None else cfg.start_step + cfg.steps - 1
        self.out, self.rank, self.cuda = run_dir / "profile", rank, device.type == "cuda"
        self._profiler: profile | None = None
        self._started_at = self._through = 0
        """The first and the last step recorded so far."""

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around the whole of training step `step` (data included)."""
        if self.first is None or not self.first <= step <= self.last:
            yield
            return
        if self._profiler is None:
            self._start(step)
        with record_function(f"belief_lm.train_step#{step}"):
            yield
        self._through = step
        if step == self._started_at and self.cuda:  # the first step recorded (a resume
            self._dump_memory(step)  # may start inside the range)
        if step == self.last:
            self.close()

    def _start(self, step: int) -> None:
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * self.cuda
        self._profiler = profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()
        self._started_at = self._through = step
        if self.cuda:
            compat.record_memory_history(MEMORY_HISTORY_ENTRIES)

    def _dump_memory(self, step: int) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"memory_rank{self.rank}_step{step}.pickle"
        compat.dump_memory_history(str(path))  # and stop recording
        log.info("CUDA memory snapshot of step %d: %s", step, path)

    def close(self) -> None:
        """Write the trace of the steps recorded (also when the run ends before the last)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        first, last = self._started_at, self._through
        steps = f"step{first}" if first == last else f"steps{first}-{last}"
        path = self.out / f"rank{self.rank}_{steps}.pt.trace.json"
        profiler.export_chrome_trace(str(path))
        if self.rank == 0:
            log.info("profile of %s written: %s", steps, path)
