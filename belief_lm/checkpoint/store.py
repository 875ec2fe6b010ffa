"""Writing checkpoints atomically, and the RNG states they carry (the layout on disk is
described in `files.py`).

A checkpoint is written under `.tmp-step_000100`, renamed when every rank has finished
and `run.json` is in place, and only then does `latest` (replaced atomically) point to it.
A crash at any moment leaves `latest` on a complete checkpoint; a directory without a
complete run.json is never loaded. Older checkpoints beyond `keep` are deleted last.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from belief_lm.checkpoint.files import (
    CheckpointInfo,
    complete_checkpoints,
    step_name,
    universal_path,
)


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
        _publish(tmp, final, info, extra_files)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(universal_path(old), ignore_errors=True)
    dist.barrier()
    return final


def save_weights(
    root: Path, info: CheckpointInfo, weights: dict[str, torch.Tensor], extra_files: dict
) -> Path:
    """Write a weights-only checkpoint (files.py) from one process, without an engine:
    `weights` (whole tensors under BeliefLM's names) in DeepSpeed's model file of a
    one-process run, atomically as `save` writes. Returns its path."""
    final = root / step_name(info.step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save({"module": weights}, tmp / "mp_rank_00_model_states.pt")
    _publish(tmp, final, info, extra_files)
    return final


def _publish(tmp: Path, final: Path, info: CheckpointInfo, extra_files: dict[str, bytes]) -> None:
    """Complete checkpoint `tmp` (its extra files, then run.json), rename it to `final` and
    point `latest` at it."""
    for name, content in extra_files.items():
        (tmp / name).write_bytes(content)
    _write_atomic(tmp / "run.json", json.dumps(asdict(info), indent=2))
    if final.exists():  # re-saving a step (e.g. resumed and stopped at once)
        shutil.rmtree(final)
    # a universal copy converted from the old weights of this step would be reused
    shutil.rmtree(universal_path(final), ignore_errors=True)
    os.replace(tmp, final)
    _write_atomic(final.parent / "latest", final.name)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
