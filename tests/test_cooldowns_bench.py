"""bench/cooldowns.py: one variant's ladder on the tests' micro run, end to end (the docs'
table and plot come from this code)."""

import json
import math

import pytest

from bench import cooldowns
from tests.jobs import MICRO


def test_a_ladder_cools_down_from_each_point(tmp_path, cache_dir):
    """A constant-rate run checkpointed at the branch points alone, a linear cooldown from
    each (its parent recorded, its rate falling from the stable one towards min_lr), and the
    ladder's tokens and losses from those runs; the plot is written."""
    root = tmp_path / "ladder"
    overrides = [f"run.cache_dir={cache_dir}", "data.num_workers=1", "train.eval_batches=2"]
    ladder = cooldowns.run_ladder(MICRO, ["softmax"], [2, 4], 2, root, overrides)
    points = ladder["softmax"]
    assert [(p["branch_step"], p["steps"], p["tokens"]) for p in points] == [
        (2, 4, 4 * 8 * 32), (4, 6, 6 * 8 * 32)  # micro: 8 sequences of 32 tokens a step
    ]  # fmt: skip
    assert all(math.isfinite(p["val_loss"]) and p["val_loss"] < math.log(4096) for p in points)
    saved = sorted(p.name for p in (root / "softmax" / "stable" / "checkpoints").glob("step_*"))
    assert saved == ["step_000002", "step_000004"]
    stable_lr = {
        row["step"]: row["lr"]
        for row in map(json.loads, (root / "softmax" / "stable" / "metrics.jsonl").open())
        if "lr" in row
    }
    for point in points:
        run = root / "softmax" / f"cool{point['branch_step']}"
        parent = json.loads((run / "environment.json").read_text())["branch_of"]
        assert parent["step"] == point["branch_step"]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
        lr = [row["lr"] for row in rows if "lr" in row]
        assert rows[-1]["step"] == point["steps"] and len(lr) == 2
        assert lr[0] == pytest.approx(stable_lr[2]) and lr[1] < lr[0]  # the decay's 2 steps
    cooldowns.plot(ladder, tmp_path / "ladder.png")
    assert (tmp_path / "ladder.png").stat().st_size > 10_000
