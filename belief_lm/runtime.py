"""Process-level set-up shared by every command: device choice, derived seeds and the run's
provenance."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

SEED_STRIDE = 1_000_003
"""A prime: seeds derived from run.seed for different parts never collide below it."""


def derived_seed(seed: int, part: int) -> int:
    """The seed of one part of a run (a model stage, a rank's RNG after a layout change):
    reproducible from run.seed, distinct per part."""
    return seed * SEED_STRIDE + part


def device_for(local_rank: int, choice: str = "auto") -> torch.device:
    """This task's device: cuda:(local_rank mod visible GPUs), or cpu.

    With the node's GPUs visible to every task (srun without per-task GPU binding) that is
    cuda:local_rank; where SLURM binds one GPU per task the task sees one GPU, cuda:0.
    """
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device=cuda but torch sees no CUDA device")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """torch.distributed backend for a device: nccl on GPU, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def select_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """The compute device for this process.

    DeepSpeed fixes its accelerator when first imported (CUDA if torch sees a GPU, else
    CPU, unless DS_ACCELERATOR says otherwise): set it here when it is not yet imported,
    and fail clearly if an earlier import chose a different one.
    """
    device = device_for(local_rank, choice)
    if "deepspeed" not in sys.modules:
        os.environ["DS_ACCELERATOR"] = device.type
    else:
        from deepspeed.accelerator import get_accelerator

        chosen = get_accelerator().device_name()
        if chosen != device.type:
            raise RuntimeError(
                f"deepspeed was imported with accelerator {chosen!r} before the run chose "
                f"{device.type!r}; set DS_ACCELERATOR={device.type}"
            )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def environment_record() -> dict:
    """What produced a run: code version, libraries, hardware, command line."""
    versions = {}
    for package in ("torch", "megatron-core", "deepspeed", "sentencepiece", "datasets", "pydantic"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    record = {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
        "python": sys.version.split()[0],
        "packages": versions,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "argv": sys.argv,
    }
    return record


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()
