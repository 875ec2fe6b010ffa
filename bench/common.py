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


def allow_bf16_on_cpu() -> None:
    """Let train.precision=bf16 run on a CPU in this process. belief-lm refuses it there
    (slow, and not what a CPU run is for), but DeepSpeed's bf16 engines run on a CPU, and a
    benchmark that checks or measures bf16 without a GPU needs them; fp32 and auto are
    resolved as before (auto: fp32 on a CPU)."""
    import belief_lm.train.engine as engine

    resolve = engine.use_bf16
    engine.use_bf16 = lambda precision, device_type: resolve(
        precision, "cuda" if precision == "bf16" else device_type
    )
