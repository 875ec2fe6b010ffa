"""Checkpoint directories on disk, read without torch: names, run.json, the newest one.

    <run_dir>/checkpoints/step_000100/     DeepSpeed's files (model, ZeRO optimizer shards)
                         /run_state/rank00003.pt   per rank: data-stream state, RNG states
                         /config.yaml, tokenizer.model
                         /run.json          written last: step, layout, "complete": true
                         /step_000100-universal/   the same step in DeepSpeed's universal form
                                                   (made when it is loaded on another layout)
                         /latest            name of the newest complete checkpoint

A weights-only checkpoint (`belief-lm import-hf` writes one at step 0) has the model file of
a one-process ZeRO-0 run and no optimizer, RNG or data state: a run starts from its
weights, at any layout, with a fresh optimizer (run.json: "weights_only": true).

Writing is `store.py`'s; this module is what pre-flight checks and tools need to find and
judge a checkpoint before anything heavy is imported.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

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
    weights_only: bool = False
    """Only the model's weights (no optimizer, RNG or data state): an imported model."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or incompatible (named)."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def universal_path(checkpoint: Path) -> Path:
    """Where the universal form of checkpoint `checkpoint` (a step directory) is kept."""
    return checkpoint.with_name(f"{checkpoint.name}-universal")


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
