"""Metrics sinks: metrics.jsonl (one JSON object per logged step) and tensorboard."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    """Writes scalars to `run_dir/metrics.jsonl` and `run_dir/tensorboard/`.

    Only the rank that logs creates one; others get `None` and skip logging.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float], prefix: str = "train") -> None:
        """Record `scalars` for `step` (non-finite values are written as null)."""
        clean = {k: (v if v is None or math.isfinite(v) else None) for k, v in scalars.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for name, value in scalars.items():
                if value is not None:
                    self._tb.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
