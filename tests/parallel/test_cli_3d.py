"""The real command at TP=2 x PP=2 x DP=2 (8 processes) on the embedded corpus, against
the same run in one process."""

import json

import pytest

from tests.jobs import run_cli

RUN = [
    "train", "--config", "configs/tiny.yaml", "model.seq_length=64",
    "train.micro_batch_size=4", "train.global_batch_size=16", "train.max_steps=12",
    "train.warmup_steps=3", "run.log_interval=6", "run.diagnostics_interval=6",
    "train.eval_interval=6", "train.eval_batches=2",
]  # fmt: skip


def metrics_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logged_losses(run_dir) -> list[float]:
    return [r["loss"] for r in metrics_rows(run_dir) if "loss" in r]


def test_belief_star_trains_at_tp2_pp2_dp2(tmp_path, cache_dir):
    result = run_cli(
        *RUN, "parallel.tensor=2", "parallel.pipeline=2", f"run.output_dir={tmp_path}",
        f"run.cache_dir={cache_dir}",
        nproc=8, timeout=540,  # inside pytest's 600 s limit, so this one stops the ranks
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    single = run_cli(
        *RUN, f"run.output_dir={tmp_path / 'single'}", f"run.cache_dir={cache_dir}", timeout=300
    )
    assert single.returncode == 0, single.stderr[-5000:]
    assert "layout TP2 x PP2 x DP2" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # every layer's gradient norm, both stages' (measured inside the pipeline engine's
    # train_batch before its update), as one process's up to the losses' own agreement
    signals = {r["step"]: r for r in rows if "layer1/grad_norm" in r}
    singles = {r["step"]: r for r in metrics_rows(tmp_path / "single") if "layer1/grad_norm" in r}
    assert sorted(signals) == sorted(singles) == [6, 12]
    for step, row in signals.items():
        norms = {f"layer{n}/grad_norm": row[f"layer{n}/grad_norm"] for n in range(1, 5)}
        expected = {key: singles[step][key] for key in norms}
        assert min(norms.values()) > 0 and norms == pytest.approx(expected, rel=1e-4), step
    validation = [r for r in rows if "val_loss" in r]
    rows = [r for r in rows if "loss" in r]
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in validation] == [6, 12]  # through the pipeline engine
    assert validation[1]["val_loss"] < validation[0]["val_loss"]
    assert [r["step"] for r in rows] == [6, 12]
    assert losses[-1] < losses[0], losses
    # the same global batches as one process: the same losses up to fp32 reduction order
    assert losses == pytest.approx(logged_losses(tmp_path / "single"), rel=1e-4)
    assert all(r["grad_norm"] > 0 and r["tflops_per_device"] > 0 for r in rows)
    diagnostics = [
        json.loads(line) for line in (tmp_path / "diagnostics.jsonl").read_text().splitlines()
    ]
    assert [d["step"] for d in diagnostics] == [6, 12]
    for layer in range(1, 5):  # both pipeline stages' layers, gathered
        ratio = diagnostics[-1][f"layer{layer}/delta_over_mh"]
        assert 0 < ratio <= 1 + 1e-5  # ||Δ|| <= ||MH||
        assert -1 <= diagnostics[-1][f"layer{layer}/cos_delta_wo_x"] <= 1
