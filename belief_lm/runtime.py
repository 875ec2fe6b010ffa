"""Process-level set-up shared by every command: device choice and the run's provenance."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from launcher.env import device_for


def select_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """The compute device for this process.

    On CPU this also points DeepSpeed at its CPU accelerator, which must happen before
    deepspeed is first imported (it picks the accelerator at import time).
    """
    device = device_for(local_rank, choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return device
    if "deepspeed" in sys.modules and os.environ.get("DS_ACCELERATOR") != "cpu":
        raise RuntimeError("deepspeed was imported before select_device chose the CPU")
    os.environ["DS_ACCELERATOR"] = "cpu"
    return torch.device("cpu")


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
