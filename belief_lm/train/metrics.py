"""What a run measures and where it goes: throughput and memory meters, and the sinks
(metrics.jsonl, one JSON object per logged step, and tensorboard)."""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path

import torch

from belief_lm.config import Config
from belief_lm.train.flops import flops_per_token, peak_tflops


class MetricsLogger:
    """Writes scalars to `run_dir/metrics.jsonl` and `run_dir/tensorboard/`.

    Only the rank that logs creates one; others get `None` and skip logging.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self._files: dict[str, object] = {}
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(
        self, step: int, scalars: dict, prefix: str = "train", jsonl: str = "metrics.jsonl"
    ) -> None:
        """Record `scalars` for `step` in `jsonl` and under `prefix/` in tensorboard
        (non-finite values are written as null)."""
        clean = {k: (v if v is None or math.isfinite(v) else None) for k, v in scalars.items()}
        if jsonl not in self._files:
            self._files[jsonl] = (self.run_dir / jsonl).open("a", buffering=1)
        self._files[jsonl].write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for name, value in scalars.items():
                if value is not None:
                    self._tb.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        if self._tb is not None:
            self._tb.close()


class Meter:
    """Throughput, utilisation and memory over each logging interval."""

    def __init__(
        self, cfg: Config, vocab_size: int, device: torch.device, world_size: int, start: int
    ):
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_step = flops_per_token(cfg.model, vocab_size) * self.tokens_per_step
        self.peak = peak_tflops(device, cfg.run.peak_tflops)
        self.device, self.world_size = device, world_size
        # a resumed run's first interval starts at its checkpoint's step, not at 0
        self.last_time, self.last_step, self.last_wait = time.perf_counter(), start, 0.0

    def scalars(
        self, step: int, loss: float, lr: float, grad_norm: float | None, data_wait_s: float
    ) -> dict:
        """The scalars of the interval ending at `step` (and the start of the next one);
        `data_wait_s`: the run's seconds spent waiting for data so far."""
        now = time.perf_counter()
        steps, elapsed = step - self.last_step, now - self.last_time
        tflops = self.flops_per_step * steps / elapsed / self.world_size / 1e12
        scalars = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.tokens_per_step * steps / elapsed,
            "step_time_s": elapsed / steps,
            "data_wait_s": (data_wait_s - self.last_wait) / steps,
            "tflops_per_device": tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            "memory_gb": self._memory_gb(),
        }
        self.last_time, self.last_step, self.last_wait = now, step, data_wait_s
        return scalars

    def _memory_gb(self) -> float:
        """Peak GPU memory allocated since the last log, or the process's peak RSS on CPU."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def format_scalars(scalars: dict[str, float | None]) -> str:
    """'loss 5.123 | lr 0.001 | ...' for a log line."""
    return " | ".join(f"{k} {'-' if v is None else f'{v:.4g}'}" for k, v in scalars.items())
