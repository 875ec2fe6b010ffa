"""What every benchmark records beside its numbers: device, commit, command, versions."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch

from belief_lm.runtime import environment_record


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def write_result(path: str | Path, result: dict, device: torch.device) -> Path:
    """Write `result` with provenance to `path` (JSON) and return the path."""
    env = environment_record()
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_description(device),
        "git_commit": env["git_commit"],
        "git_dirty": env["git_dirty"],
        "packages": env["packages"],
        **result,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def bench_trainee(cfg, grid, vocab_size: int, device: torch.device, eos_id: int | None = None):
    """build_trainee on process grid `grid` with what pre-flight decides for `cfg`
    (precision, accumulation), except
    that train.precision=bf16 runs on a CPU too: belief-lm refuses it there (slow, and not
    what a CPU run is for), but DeepSpeed's bf16 engines run on a CPU, and a benchmark that
    checks or measures bf16 without a GPU needs them. `eos_id`: where documents end under
    model.attention_mask=document."""
    from belief_lm.preflight import grad_accumulation_steps, use_bf16
    from belief_lm.train.engine import build_trainee

    precision = cfg.train.precision
    bf16 = precision == "bf16" or use_bf16(precision, device.type)
    accumulation = grad_accumulation_steps(cfg, grid.layout.data)
    return build_trainee(
        cfg, grid, vocab_size, device, bf16=bf16, accumulation=accumulation, eos_id=eos_id
    )
