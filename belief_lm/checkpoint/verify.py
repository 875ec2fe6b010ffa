"""`belief-lm checkpoint verify RUN_DIR`: every checkpoint of a run judged against its
manifest, intact or damaged (and why), and the one a resume would take. With checksums, an
intact checkpoint's torch files are also held to what a checkpoint may hold
(belief_lm/checkpoint/loading.py: their pickles read, none of it run; this imports torch,
the module itself does not): one beyond it is refused by every command that loads it.

Exit code (the command's): 0 when the newest checkpoint (the highest step) is intact and
not refused, 2 when it is damaged, refused or there is none, so a job script can check a
run before requeueing it.
`belief-lm checkpoint seal STEP_DIR` gives a checkpoint saved before manifests existed its
manifest, trusting its files as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from belief_lm.checkpoint import manifest
from belief_lm.checkpoint.files import (
    CheckpointError,
    Choice,
    checkpoints_dir,
    choose_checkpoint,
    problems,
    read_info,
    step_dirs,
)


@dataclass(frozen=True)
class Verdict:
    """One checkpoint's state."""

    path: Path
    problems: list[str]
    """Empty: intact."""
    files: int
    """Files its manifest lists (0 without a readable manifest)."""
    size: int
    """Their bytes."""
    refused: list[str] = field(default_factory=list)
    """Files holding more than a checkpoint may (loading.refusals; checked with checksums,
    on an intact checkpoint)."""


@dataclass(frozen=True)
class RunCheck:
    """Every checkpoint of a run, newest first, and the one a resume would take."""

    root: Path
    verdicts: list[Verdict]
    choice: Choice

    @property
    def newest_intact(self) -> bool:
        return bool(self.verdicts) and not self.verdicts[0].problems

    @property
    def newest_loadable(self) -> bool:
        """The newest checkpoint is intact and none of its files is refused."""
        return self.newest_intact and not self.verdicts[0].refused


def check_run(
    run_dir: str | Path, checksums: bool = True, workers: int = manifest.WORKERS
) -> RunCheck:
    """Judge every checkpoint of run `run_dir` (or of a checkpoints directory)."""
    root = checkpoints_dir(Path(run_dir).expanduser())
    verdicts = []
    for _, path in reversed(step_dirs(root)):
        try:
            records = manifest.read_manifest(path)
        except manifest.ManifestError:
            records = {}
        size = sum(record.size for record in records.values())
        found = problems(path, checksums, workers)
        refused = []
        if checksums and not found:
            from belief_lm.checkpoint.loading import refusals  # torch: only when checking

            refused = refusals(path, sorted(records))
        verdicts.append(Verdict(path, found, len(records), size, refused))
    known = {verdict.path: verdict.problems for verdict in verdicts}
    return RunCheck(root, verdicts, choose_checkpoint(root, known.__getitem__))


def report(check: RunCheck, checksums: bool = True) -> str:
    """The lines `checkpoint verify` prints."""
    if not check.verdicts:
        return f"{check.root}: no checkpoints"
    how = "checksums" if checksums else "sizes only"
    lines = [f"{check.root} ({how}; newest first):"]
    for verdict in check.verdicts:
        if verdict.problems:
            state = "damaged: " + "; ".join(verdict.problems)
        else:
            state = f"intact ({verdict.files} files, {_size(verdict.size)})"
        if verdict.refused:
            state += "; refused: " + "; ".join(verdict.refused)
        lines.append(f"  {verdict.path.name}  {state}")
    if check.choice.latest_problem is not None:
        lines.append(f"  latest: {check.choice.latest_problem}")
    taken = check.choice.path
    newest = check.verdicts[0].path.name
    state = "intact" if check.newest_intact else "damaged"
    if check.newest_intact and not check.newest_loadable:
        state = "refused (loading it could run code)"
    line = f"newest checkpoint {newest} is {state}; a resume would take " + (
        taken.name if taken is not None else "none (no intact checkpoint)"
    )
    if taken is not None and any(v.path == taken and v.refused for v in check.verdicts):
        line += ", and refuse it (exit 2) unless --trust-checkpoint (checkpoint.trust=true)"
    lines.append(line)
    return "\n".join(lines)


def seal_legacy(checkpoint: str | Path) -> str:
    """Write the manifest of `checkpoint`, a complete checkpoint without one (saved by a
    belief-lm before manifests), from its files as they are; what was done, in a line.
    CheckpointError if it is missing, incomplete or has a manifest already."""
    path = Path(checkpoint).expanduser()
    read_info(path)  # there, and complete
    if (path / manifest.MANIFEST).exists():
        raise CheckpointError(
            f"checkpoint {path} has a manifest already: `belief-lm checkpoint verify` checks it"
        )
    manifest.seal(path)
    records = manifest.read_manifest(path)
    size = sum(record.size for record in records.values())
    return f"sealed {path}: {len(records)} files, {_size(size)}, as they are now"


def _size(size: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError  # unreachable
