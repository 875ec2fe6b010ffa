"""The real command at TP=2 x PP=2 x DP=2 (8 processes) on the embedded corpus."""

import json

from tests.jobs import run_cli


def test_belief_star_trains_at_tp2_pp2_dp2(tmp_path, cache_dir):
    result = run_cli(
        "train", "--config", "configs/tiny.yaml",
        "parallel.tensor=2", "parallel.pipeline=2", "model.seq_length=64",
        "train.micro_batch_size=4", "train.global_batch_size=16", "train.max_steps=30",
        "train.warmup_steps=5", "run.diagnostics_interval=15", "train.eval_interval=15",
        "train.eval_batches=2",
        f"run.output_dir={tmp_path}", f"run.cache_dir={cache_dir}",
        nproc=8, timeout=540,  # inside pytest's 600 s limit, so this one stops the ranks
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    assert "layout TP2 x PP2 x DP2" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in rows if "val_loss" in r]
    rows = [r for r in rows if "loss" in r]
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in validation] == [15, 30]  # through the pipeline engine
    assert validation[1]["val_loss"] < validation[0]["val_loss"]
    assert [r["step"] for r in rows] == list(range(10, 31, 10))
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(r["grad_norm"] > 0 and r["tflops_per_device"] > 0 for r in rows)
    diagnostics = [
        json.loads(line) for line in (tmp_path / "diagnostics.jsonl").read_text().splitlines()
    ]
    assert [d["step"] for d in diagnostics] == [15, 30]
    for layer in range(1, 5):  # both pipeline stages' layers, gathered
        ratio = diagnostics[-1][f"layer{layer}/delta_over_mh"]
        assert 0 < ratio <= 1 + 1e-5  # ||Δ|| <= ||MH||
        assert -1 <= diagnostics[-1][f"layer{layer}/cos_delta_wo_x"] <= 1
