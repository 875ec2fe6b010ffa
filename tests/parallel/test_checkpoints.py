"""Checkpoints across processes: bit-exact resume on the same layout (the real command),
resume on other layouts (universal checkpoints), evaluation on another layout."""

import json

import pytest

from belief_lm.checkpoint.files import universal_path
from belief_lm.checkpoint.loading import refusals
from tests.jobs import MICRO, run_cli
from tests.parallel.conftest import assert_equivalent, load_run, run_driver


def train(nproc, run_dir, cache_dir, *overrides):
    result = run_cli(
        "train", "--config", MICRO, f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}",
        *overrides, nproc=nproc, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory, cache_dir):
    """TP=2 x DP=2 with ZeRO-2, 6 steps, checkpoints at 3 and 6."""
    run_dir = tmp_path_factory.mktemp("zero2")
    layout = ["parallel.tensor=2", "parallel.zero_stage=2", "checkpoint.interval=3"]
    return run_dir, layout, train(4, run_dir, cache_dir, *layout)


def test_bit_exact_resume_zero2_tp2_dp2(zero2_run, tmp_path, cache_dir):
    run_dir, layout, losses = zero2_run
    step3 = run_dir / "checkpoints" / "step_000003"
    assert refusals(step3) == []  # nothing beyond what a checkpoint may hold (loading.py)
    resumed = train(4, tmp_path, cache_dir, *layout, f"checkpoint.resume={step3}")
    assert list(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [losses[s] for s in (4, 5, 6)]


def test_resume_across_sequence_parallel(zero2_run, tmp_path, cache_dir):
    """zero2_run trains at TP=2 with sequence parallelism (the default there); its step-3
    checkpoint resumes with it off at the same layout, and that run's step-4 checkpoint
    (saved without it) resumes with it on again: it changes no weight or optimizer state,
    so every step gives zero2_run's loss (up to the order of fp32 sums)."""
    run_dir, layout, losses = zero2_run
    step3 = run_dir / "checkpoints" / "step_000003"
    off, on = "parallel.sequence_parallel=false", "parallel.sequence_parallel=true"
    saved_off = tmp_path / "off"
    resumed = train(
        4, saved_off, cache_dir, *layout, off, "checkpoint.interval=1", "checkpoint.keep=3",
        f"checkpoint.resume={step3}",
    )  # fmt: skip
    assert list(resumed) == [4, 5, 6]
    step4 = saved_off / "checkpoints" / "step_000004"
    resumed_on = train(4, tmp_path / "on", cache_dir, *layout, on, f"checkpoint.resume={step4}")
    assert list(resumed_on) == [5, 6]
    expected = [losses[s] for s in (4, 5, 6)]
    assert [resumed[s] for s in (4, 5, 6)] == pytest.approx(expected, rel=1e-5)
    assert [resumed_on[s] for s in (5, 6)] == pytest.approx(expected[1:], rel=1e-5)


def test_bit_exact_resume_tp2_pp2(tmp_path, cache_dir):
    layout = ["parallel.tensor=2", "parallel.pipeline=2", "checkpoint.interval=3"]
    losses = train(4, tmp_path / "a", cache_dir, *layout)
    step3 = tmp_path / "a" / "checkpoints" / "step_000003"
    assert refusals(step3) == []
    resumed = train(4, tmp_path / "b", cache_dir, *layout, f"checkpoint.resume={step3}")
    assert [resumed[s] for s in (4, 5, 6)] == [losses[s] for s in (4, 5, 6)]


def test_evaluate_on_another_layout(zero2_run, tmp_path):
    run_dir, _, _ = zero2_run
    step6 = str(run_dir / "checkpoints" / "step_000006")
    results = {}
    for nproc, tensor in ((2, 2), (1, 1)):
        out = tmp_path / f"eval-tp{tensor}.json"
        done = run_cli(
            "evaluate", "--checkpoint", step6, "--tensor", str(tensor), "--output", str(out),
            nproc=nproc, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-4000:]
        results[tensor] = json.loads(out.read_text())
    assert results[1]["tokens"] == results[2]["tokens"] > 0
    assert results[1]["step"] == 6
    assert results[1]["loss"] == pytest.approx(results[2]["loss"], rel=1e-6)


@pytest.fixture(scope="module")
def saved_8_ranks(tp2_pp2_dp2):
    """belief_star trained 3 steps at TP=2 x PP=2 x DP=2 (ZeRO-1), checkpointed at step 3."""
    return tp2_pp2_dp2 / "checkpoints" / "step_000003"


@pytest.fixture(scope="module")
def reference_6_steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref6")
    return load_run(run_driver(out, 1, 1, 1, 1, ["belief_star"], "--steps", "6"), "belief_star", 1)


@pytest.mark.parametrize(("tp", "pp", "dp"), [(1, 1, 1), (1, 2, 1)], ids=["tp1pp1", "tp1pp2"])
def test_resume_on_another_layout(saved_8_ranks, reference_6_steps, tmp_path, tp, pp, dp):
    """Continuing steps 4-6 elsewhere equals the single process's steps 4-6: losses,
    gradients, grad norms, final weights (the optimizer state came along)."""
    out = run_driver(
        tmp_path, tp, pp, dp, 1, ["belief_star"], "--resume", str(saved_8_ranks), "--steps", "6"
    )
    resumed = load_run(out, "belief_star", 1)
    assert refusals(saved_8_ranks) == refusals(universal_path(saved_8_ranks)) == []
    later = {
        "losses": reference_6_steps["losses"][3:],
        "grad_norms": reference_6_steps["grad_norms"][3:],
        "grads": reference_6_steps["grads"][3:],
        "params": reference_6_steps["params"],
    }
    assert_equivalent(resumed, later, first_step_exact=False)


def test_streaming_parquet_two_ranks_stop_and_resume(tmp_path, cache_dir):
    """Issue 3's end to end: 2 data-parallel ranks (2 loader workers each) train on
    FineWeb-Edu-schema parquet through the hub code path; stopped at step 3 and resumed,
    the run's losses (so its batches) equal those of an uninterrupted run."""
    from tests.data_pipeline.corpora import write_fineweb

    write_fineweb(tmp_path / "fineweb-edu", files=4, rows_per_file=12, row_group_size=4, chars=600)
    data = [
        f"data.sources=[{{uri: 'hf:{tmp_path / 'fineweb-edu'}:sample-10BT', id_column: id}}]",
        "data.num_workers=2", "data.tokenizer.vocab_size=512", "data.validation_fraction=0.05",
        f"run.cache_dir={tmp_path / 'cache'}", "checkpoint.interval=3",
    ]  # fmt: skip
    whole = train(2, tmp_path / "whole", cache_dir, *data)
    step3 = tmp_path / "whole" / "checkpoints" / "step_000003"
    resumed = train(2, tmp_path / "resumed", cache_dir, *data, f"checkpoint.resume={step3}")
    assert list(resumed) == [4, 5, 6]
    assert [resumed[s] for s in (4, 5, 6)] == [whole[s] for s in (4, 5, 6)]
