"""The run directory: effective config and provenance, written before training starts,
and a record of every start of the run (first start, resumes)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from belief_lm.config import Config
from belief_lm.runtime import environment_record


def prepare_run_dir(cfg: Config, write: bool = True) -> Path:
    """Create run.output_dir with config.yaml (every effective value) and environment.json
    (git commit, library versions, hardware, command). Only the writing rank writes."""
    run_dir = Path(cfg.run.output_dir).expanduser()
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        (run_dir / "environment.json").write_text(json.dumps(environment_record(), indent=2))
    return run_dir


STARTS = "starts.jsonl"
"""One line per start of the run: {"step": the step it started from (0, or the checkpoint
it resumed), "time", "world_size", "git_commit", "host"}, and for a restart in place after
a failure (launch.failure_restarts) "restart": {"restart": k, "of": N, "cause": "rank
died" | "rank failed" | "peer lost", "rank", "host", "signal" or "exit_code", and "silent":
the ranks a peer-lost report named}; `belief-lm report` counts the resumes from it."""
RESTART_VARIABLE = "BELIEF_LM_RESTART"
"""Where the launcher (`launch local`, the sbatch template) that restarted the ranks in
place puts the restart's cause (JSON) for this record (launcher.local.RESTART_VARIABLE)."""


def record_start(run_dir: Path, step: int, world_size: int) -> None:
    """Append this start of the run to `run_dir/starts.jsonl`."""
    environment = json.loads((run_dir / "environment.json").read_text())
    record = {
        "step": step,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "world_size": world_size,
        "git_commit": environment["git_commit"],
        "host": environment["host"],
    }
    restart = os.environ.get(RESTART_VARIABLE)
    if restart:
        try:
            record["restart"] = json.loads(restart)
        except ValueError:  # a hand-written value: kept as written
            record["restart"] = restart
    path = run_dir / STARTS
    cut = path.is_file() and path.read_bytes()[-1:] not in (b"", b"\n")  # by a crash mid-write
    with path.open("a") as file:
        file.write(("\n" if cut else "") + json.dumps(record) + "\n")


def drop_metrics_after(run_dir: Path, step: int) -> None:
    """Keep only the rows up to `step` in every per-step log (metrics.jsonl,
    diagnostics.jsonl): a resumed run logs the later ones again, and a row a crash cut
    short is dropped. (starts.jsonl is the run's history, not a per-step log: it keeps
    every start.)"""
    for path in run_dir.glob("*.jsonl"):
        if path.name == STARTS:
            continue
        rows = [r for r in path.read_text(errors="replace").splitlines() if _step(r) <= step]
        path.write_text("".join(f"{r}\n" for r in rows))


def _step(row: str) -> float:
    """The step of a per-step log's row (infinite for a line that is no row: dropped)."""
    try:
        step = json.loads(row)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
    return step if type(step) is int else float("inf")
