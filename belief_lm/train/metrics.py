"""What a run measures and where it goes: throughput and memory meters, and the sinks the
logging rank writes every scalar to: metrics.jsonl (one JSON object per logged step),
tensorboard and Weights & Biases (run.wandb), all behind one interface."""

from __future__ import annotations

import json
import math
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import Protocol

import torch

from belief_lm.config import Config
from belief_lm.train.flops import flops_per_token, peak_tflops

Scalars = dict[str, float | None]


class Sink(Protocol):
    """Where logged scalars go. `prefix` groups them (train, val, belief, ...), `jsonl`
    names the file a line-per-step sink writes them to."""

    def write(self, step: int, scalars: Scalars, prefix: str, jsonl: str) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """`run_dir/<jsonl>`: one JSON object per call, {"step": ..., **scalars}; non-finite
    values are written as null. Appends: a resumed run continues the same files."""

    def __init__(self, run_dir: Path):
        self.run_dir, self._files = run_dir, {}

    def write(self, step: int, scalars: Scalars, prefix: str, jsonl: str) -> None:
        clean = {k: (v if v is None or math.isfinite(v) else None) for k, v in scalars.items()}
        if jsonl not in self._files:
            self._files[jsonl] = (self.run_dir / jsonl).open("a", buffering=1)
        self._files[jsonl].write(json.dumps({"step": step, **clean}) + "\n")

    def close(self) -> None:
        for file in self._files.values():
            file.close()


class TensorboardSink:
    """Tensorboard event files under `log_dir`, scalars named `prefix/name`."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, scalars: Scalars, prefix: str, jsonl: str) -> None:
        for name, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run with the tensorboard names (`prefix/name`) at the trainer's
    step. Its id is kept in `run_dir/wandb/run_id`, so a resumed run continues the same W&B
    run; offline runs are written under `run_dir/wandb/` for `wandb sync`."""

    ID_FILE = Path("wandb") / "run_id"

    def __init__(self, cfg: Config, run_dir: Path, resumed: bool):
        import wandb  # the wandb extra; pre-flight refused the run if it is missing

        settings = cfg.run.wandb
        id_file = run_dir / self.ID_FILE
        run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
        if run_id is None:
            run_id = secrets.token_hex(4)  # W&B's own ids: 8 lowercase letters/digits
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        self._run = wandb.init(
            mode=settings.mode, project=settings.project, entity=settings.entity,
            name=settings.name or run_dir.resolve().name, tags=settings.tags, id=run_id,
            resume="allow", dir=str(run_dir),
        )  # fmt: skip
        # the run config: every effective value, and what produced the run; a resume may
        # change some (train.max_steps), which W&B refuses unless told
        environment = json.loads((run_dir / "environment.json").read_text())
        config = {**cfg.model_dump(mode="json"), "environment": environment}
        self._run.config.update(config, allow_val_change=True)

    @property
    def id(self) -> str:
        return self._run.id

    def write(self, step: int, scalars: Scalars, prefix: str, jsonl: str) -> None:
        values = {f"{prefix}/{k}": v for k, v in scalars.items() if v is not None}
        # W&B keeps the first values it got for a step: the steps a resumed run repeats
        # (logged before a crash, after its checkpoint) are dropped; on the same layout
        # they are the same numbers (bit-exact resume)
        self._run.log(values, step=step)

    def close(self) -> None:
        failed = sys.exc_info()[0] is not None  # closed while an exception propagates
        self._run.finish(exit_code=1 if failed else 0)


class MetricsLogger:
    """Writes scalars to every sink of the run: metrics.jsonl always, tensorboard
    (run.tensorboard) and W&B (run.wandb.mode) when enabled.

    Only the rank that logs creates one; others get `None` and skip logging.
    """

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, resumed: bool = False) -> MetricsLogger:
        """The run's sinks; `resumed`: the run continues from a checkpoint (and its W&B run)."""
        sinks: list[Sink] = [JsonlSink(run_dir)]
        if cfg.run.tensorboard:
            sinks.append(TensorboardSink(run_dir / "tensorboard"))
        if cfg.run.wandb.mode != "disabled":
            sinks.append(WandbSink(cfg, run_dir, resumed))
        return cls(sinks)

    def log(
        self, step: int, scalars: Scalars, prefix: str = "train", jsonl: str = "metrics.jsonl"
    ) -> None:
        """Record `scalars` for `step` in `jsonl` and under `prefix/` elsewhere."""
        for sink in self.sinks:
            sink.write(step, scalars, prefix, jsonl)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


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
