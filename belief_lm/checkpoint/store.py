"""Where checkpoints live and how they are written and found.

    <run_dir>/checkpoints/step_000100/     DeepSpeed's files (model, ZeRO optimizer shards)
                         /run_state/rank00003.pt   per rank: data-stream state, RNG states
                         /config.yaml, tokenizer.model
                         /run.json          written last: step, layout, "complete": true
                         /latest            name of the newest complete checkpoint

A checkpoint is written under `.tmp-step_000100`, renamed when every rank has finished
and `run.json` is in place, and only then does `latest` (replaced atomically) point to it.
A crash at any moment leaves `latest` on a complete checkpoint; a directory without a
complete run.json is never loaded. Older checkpoints beyond `keep` are deleted last.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclass(frozen=True)
class CheckpointInfo:
    """The contents of run.json: what was saved, by which layout."""

    step: int
    consumed_tokens: int
    tensor: int
    pipeline: int
    data: int
    zero_stage: int
    vocab_size: int
    complete: bool = True


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or incompatible (named)."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def read_info(path: Path) -> CheckpointInfo:
    """run.json of checkpoint `path`, or CheckpointError saying what is wrong with it."""
    meta = path / "run.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not meta.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no run.json): not loading it")
    try:
        info = CheckpointInfo(**json.loads(meta.read_text()))
    except (json.JSONDecodeError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path}: corrupt run.json ({err})") from None
    if not info.complete:
        raise CheckpointError(f"checkpoint {path} is marked incomplete")
    return info


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        match = STEP_DIR.match(child.name)
        if match:
            try:
                read_info(child)
            except CheckpointError:
                continue
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def newest_checkpoint(root: Path) -> Path | None:
    """What `latest` names if that is complete, else the newest complete checkpoint."""
    latest = root / "latest"
    if latest.is_file():
        named = root / latest.read_text().strip()
        try:
            read_info(named)
            return named
        except CheckpointError:
            pass
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    engine,
    root: Path,
    info: CheckpointInfo,
    rank_state: dict,
    extra_files: dict[str, bytes],
    client_state: dict,
    keep: int,
) -> Path:
    """Write a checkpoint of `engine` (collective: every rank calls it) and return its
    path. `rank_state` is this rank's (data stream, RNG); `extra_files` are written by
    rank 0 (config, tokenizer)."""
    rank = dist.get_rank()
    final = root / step_name(info.step)
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state, save_latest=False)
    (tmp / "run_state").mkdir(parents=True, exist_ok=True)
    torch.save(rank_state, tmp / "run_state" / f"rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        for name, content in extra_files.items():
            (tmp / name).write_bytes(content)
        _write_atomic(tmp / "run.json", json.dumps(asdict(info), indent=2))
        if final.exists():  # re-saving a step (e.g. resumed and stopped at once)
            shutil.rmtree(final)
        # a universal copy converted from the old weights of this step would be reused
        shutil.rmtree(final.with_name(f"{final.name}-universal"), ignore_errors=True)
        os.replace(tmp, final)
        _write_atomic(root / "latest", final.name)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(old.with_name(f"{old.name}-universal"), ignore_errors=True)
    dist.barrier()
    return final


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
