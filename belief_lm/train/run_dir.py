"""The run directory: effective config and provenance, written before training starts."""

from __future__ import annotations

import json
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


def drop_metrics_after(run_dir: Path, step: int) -> None:
    """Keep only the rows up to `step` in every per-step log (metrics.jsonl,
    diagnostics.jsonl): a resumed run logs the later ones again."""
    for path in run_dir.glob("*.jsonl"):
        rows = [r for r in path.read_text().splitlines() if json.loads(r)["step"] <= step]
        path.write_text("".join(f"{r}\n" for r in rows))
