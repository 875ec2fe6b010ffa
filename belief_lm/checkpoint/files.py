"""Checkpoint directories on disk, read without torch: names, run.json, the newest one.

    <run_dir>/checkpoints/step_000100/     DeepSpeed's files (model, ZeRO optimizer shards)
                         /run_state/rank00003.pt   per rank: data-stream state, RNG states
                         /config.yaml, tokenizer.model
                         /manifest.json     every file's size and CRC-32 (manifest.py)
                         /run.json          written last: step, layout, "complete": true
                         /step_000100-universal/   the same step in DeepSpeed's universal form
                                                   (made when it is loaded on another layout)
                         /latest            name of the newest complete checkpoint

A weights-only checkpoint (`belief-lm import-hf` writes one at step 0) has the model file of
a one-process ZeRO-0 run and no optimizer, RNG or data state: a run starts from its
weights, at any layout, with a fresh optimizer (run.json: "weights_only": true).

Writing is `store.py`'s; this module is what pre-flight checks and tools need to find and
judge a checkpoint before anything heavy is imported. A checkpoint is *intact* when its
run.json says complete and every file is as its manifest recorded it; a damaged one is
never resumed from: `newest_checkpoint` skips it with a warning naming the file.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from pathlib import Path

from belief_lm.checkpoint import manifest
from belief_lm.errors import BadInput

log = logging.getLogger("belief_lm.checkpoint")

STEP_DIR = re.compile(r"^step_(\d{6,})$")
LATEST = "latest"


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


class CheckpointError(BadInput):
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
    except (ValueError, TypeError) as err:  # not JSON, not UTF-8, not an object, unknown keys
        raise CheckpointError(f"checkpoint {path}: corrupt run.json ({err})") from None
    wrong = [
        f"{f.name}={getattr(info, f.name)!r}"
        for f in fields(CheckpointInfo)
        if type(getattr(info, f.name)) is not (bool if f.type == "bool" else int)
        or (f.type == "int" and getattr(info, f.name) < 0)
    ]
    if wrong:
        raise CheckpointError(f"checkpoint {path}: corrupt run.json ({', '.join(wrong)})")
    if not info.complete:
        raise CheckpointError(f"checkpoint {path} is marked incomplete")
    return info


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoints under `root` whose run.json says complete, oldest first (intact or not:
    see `problems`)."""
    found = []
    for _, child in step_dirs(root):
        try:
            read_info(child)
        except CheckpointError:
            continue
        found.append(child)
    return found


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every step directory under `root`, complete or not, oldest first."""
    found = []
    for child in root.iterdir() if root.is_dir() else ():
        match = STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def problems(path: Path, checksums: bool = False, workers: int = manifest.WORKERS) -> list[str]:
    """What is wrong with checkpoint `path`, each naming the file; empty if it is intact.
    `checksums`: read every file through (else sizes only: one stat per file)."""
    if not path.is_dir():
        return [f"{path} does not exist"]
    if not (path / "run.json").is_file():
        return ["run.json is missing (the save did not finish)"]
    found = manifest.verify(path, checksums, workers)
    if not found:
        try:
            read_info(path)
        except CheckpointError as err:
            found.append(str(err))
    return found


def damaged(path: Path, found: list[str]) -> CheckpointError:
    """The error for checkpoint `path` with `problems` `found`."""
    return CheckpointError(f"checkpoint {path} is damaged: {'; '.join(found)}")


class LatestError(BadInput):
    """`latest` exists but does not name a checkpoint (the message says why)."""


def read_latest(root: Path) -> str | None:
    """The checkpoint name `root`/latest holds (None if there is no `latest`); LatestError
    if it is unreadable (garbage bytes, an empty or foreign name)."""
    path = root / LATEST
    try:
        text = path.read_bytes().decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise LatestError(f"{path} is unreadable ({err})") from None
    if not STEP_DIR.match(text):
        raise LatestError(f"{path} is unreadable (it holds {text[:40]!r}, not a step name)")
    return text


@dataclass(frozen=True)
class Choice:
    """The checkpoint a resume takes, and what it passed over on the way."""

    path: Path | None
    """None: no intact checkpoint."""
    passed_over: list[tuple[Path, list[str]]]
    """Damaged checkpoints newer than `path` (or named by `latest`), with their problems."""
    latest_problem: str | None
    """Why `latest` could not be followed, if it was unreadable."""


def checkpoints_dir(run_dir: Path) -> Path:
    """RUN_DIR/checkpoints, or RUN_DIR itself if it holds step directories."""
    nested = run_dir / "checkpoints"
    return nested if nested.is_dir() or not step_dirs(run_dir) else run_dir


def named_checkpoint(given: Path, checksums: bool = True) -> tuple[Path, bool]:
    """The checkpoint a command was given: a step directory as it is, or for a run
    directory (or its checkpoints directory) the one a resume would take, logged; and
    whether that one was judged intact on the way (by checksums if `checksums`).
    CheckpointError if a run has no intact checkpoint."""
    root = checkpoints_dir(given)
    if (given / "run.json").exists() or not step_dirs(root):
        return given, False
    chosen = newest_checkpoint(root, checksums)
    if chosen is None:
        raise CheckpointError(
            f"{given}: no intact checkpoint (`belief-lm checkpoint verify {given}` lists why)"
        )
    log.info("%s: its newest intact checkpoint is %s", given, chosen.name)
    return chosen, True


def choose_checkpoint(root: Path, judge: Callable[[Path], list[str]]) -> Choice:
    """The checkpoint under `root` to resume from: the one `latest` names if it is intact;
    if that one is damaged, the newest intact one before it; if `latest` is missing or
    unreadable, the newest intact one. `judge(path)` gives a checkpoint's problems."""
    latest_problem = None
    try:
        named = read_latest(root)
    except LatestError as err:
        latest_problem, named = str(err), None
    candidates = step_dirs(root)
    if named is not None and (root / named).is_dir():
        step = int(STEP_DIR.match(named).group(1))
        candidates = [(s, p) for s, p in candidates if s <= step]
    passed_over = []
    for _, path in reversed(candidates):
        found = judge(path)
        if not found:
            return Choice(path, passed_over, latest_problem)
        passed_over.append((path, found))
    return Choice(None, passed_over, latest_problem)


def newest_checkpoint(
    root: Path, checksums: bool = False, skip: Collection[Path] = ()
) -> Path | None:
    """The checkpoint to resume from (`choose_checkpoint`), judged by `problems` (sizes, or
    also `checksums`); None if none is intact. Each damaged checkpoint passed over, and an
    unreadable `latest`, is a warning naming the file. `skip`: checkpoints the caller
    already found damaged and reported (a second look, which does not report `latest`
    again either)."""

    def judge(path: Path) -> list[str]:
        return ["found damaged"] if path in skip else problems(path, checksums)

    choice = choose_checkpoint(root, judge)
    if choice.latest_problem is not None and not skip:
        log.warning("%s: resuming from the newest intact checkpoint", choice.latest_problem)
    for path, found in choice.passed_over:
        if path not in skip:
            log.warning("%s; skipping it for an older checkpoint", damaged(path, found))
    return choice.path
