"""bench/compare.py: curves from metrics, the summary over seeds, the plot, one real run."""

import argparse
import math

import pytest

from bench import compare


def rows(losses, step_time=0.5):
    out = []
    for step, loss in enumerate(losses, start=1):
        out.append({"step": step, "loss": 9.0, "step_time_s": step_time})
        if step % 2 == 0:
            out.append({"step": step, "val_loss": loss})
    return out


def test_curve_and_summary():
    a = compare.curve(rows([0, 5.0, 0, 4.0]))
    b = compare.curve(rows([0, 6.0, 0, 5.0], step_time=1.0))
    assert a == {2: (5.0, 1.0), 4: (4.0, 2.0)}
    summary = compare.summarize({"belief": [a, b]})["belief"]
    assert summary["steps"] == [2, 4] and summary["seeds"] == 2
    assert summary["val_loss_mean"] == [5.5, 4.5]
    assert summary["val_loss_std"] == pytest.approx([math.sqrt(0.5)] * 2)
    assert summary["seconds_mean"] == [1.5, 3.0]
    assert summary["per_seed_final_val_loss"] == [4.0, 5.0]


def test_plot(tmp_path):
    curves = {
        "softmax": [compare.curve(rows([0, 5, 0, 4]))],
        "belief_star": [compare.curve(rows([0, 4.8, 0, 3.9]))],
    }
    compare.plot(compare.summarize(curves), tmp_path / "c.png", "test")
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_runs_under_each_mask_by_name(tmp_path):
    """--masks causal document: each variant under each model.attention_mask, named apart."""
    args = argparse.Namespace(config="c.yaml", steps=4, eval_interval=2, eval_batches=2,
                              launcher=None, overrides=["x.y=1"])  # fmt: skip
    command = compare.train_command("belief", 3, args, tmp_path, "document")
    assert "model.attention_mask=document" in command and command[-1] == "x.y=1"
    assert compare.run_name("belief", "document", ["causal", "document"]) == "belief (document)"
    assert compare.run_name("belief", "causal", ["causal"]) == "belief"


def test_one_real_run(tmp_path, cache_dir):
    args = argparse.Namespace(
        config="configs/tiny.yaml", steps=4, eval_interval=2, eval_batches=2, launcher=None,
        overrides=["model.num_layers=1", "model.seq_length=32", f"run.cache_dir={cache_dir}"],
    )  # fmt: skip
    curve = compare.curve(compare.train_one("belief", 1, args, tmp_path / "run"))
    assert sorted(curve) == [2, 4]
    assert curve[4][0] < curve[2][0] < math.log(4096) + 0.1
    assert 0 < curve[2][1] < curve[4][1]
