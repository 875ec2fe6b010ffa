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
