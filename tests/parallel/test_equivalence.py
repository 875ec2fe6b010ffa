"""Distributed training equals single-process training, from the same initial weights
(run.seed) on the same global batches: losses, every gradient at every step, and the final
weights, within fp32 tolerance."""

from pathlib import Path

import pytest

from belief_lm.variants import VARIANTS
from tests.parallel.conftest import (
    STABILITY_VARIANTS,
    assert_equivalent,
    load_run,
    run_driver,
    torchrun,
)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_every_variant(reference, tp2, variant):
    assert_equivalent(load_run(tp2, variant, 1), load_run(reference, variant, 1))


@pytest.mark.parametrize("variant", STABILITY_VARIANTS)
def test_qk_norm_and_z_loss_tp2(reference, tp2, variant):
    """model.qk_norm (each rank normalizes its own heads with the shared weights, whose
    gradient is summed over the ranks) and train.z_loss (the log-sum-exp over both
    vocabulary shards) over loss chunks at TP=2: the single process's losses, z-losses,
    gradients and weights with the plain loss. Both options change the run."""
    name = f"{variant}-stability"
    run, single = load_run(tp2, name, 1), load_run(reference, name, 1)
    assert_equivalent(run, single)
    assert len(single["z_losses"]) == 3 and min(single["z_losses"]) > 0
    assert run["z_losses"] == pytest.approx(single["z_losses"], rel=1e-5)
    assert "layers.0.self_attention.q_layernorm.weight" in single["params"]
    plain = load_run(reference, variant, 1)
    assert single["losses"][0] != pytest.approx(plain["losses"][0], abs=1e-4)


def test_belief_star_tp2_pp2_dp2(reference, tp2_pp2_dp2):
    """Tensor and pipeline parallel together (with data parallel and ZeRO-1 on top: the
    run the change-of-layout tests resume from, so TP=2 x PP=2 needs no run of its own),
    plain and with QK-norm and a z-loss (the z-loss the pipeline engine sums over
    micro-batches and averages over data parallelism)."""
    run = load_run(tp2_pp2_dp2, "belief_star", 1)
    assert_equivalent(run, load_run(reference, "belief_star", 1))
    run = load_run(tp2_pp2_dp2, "belief_star-stability", 1)
    single = load_run(reference, "belief_star-stability", 1)
    assert_equivalent(run, single)
    assert run["z_losses"] == pytest.approx(single["z_losses"], rel=1e-5)


@pytest.fixture(scope="module")
def pipeline_losses(tmp_path_factory) -> Path:
    """belief_star at PP=2 with the plain and the chunked loss, tied and untied, and with
    compiled layers (untied), in one job (tests/parallel/pipeline_loss.py)."""
    out = tmp_path_factory.mktemp("pipeline_loss")
    result = torchrun(2, "tests/parallel/pipeline_loss.py", str(out), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out


@pytest.mark.parametrize("tie", ["tied", "untied"])
def test_chunked_loss_pp2(pipeline_losses, tie):
    """train.loss_chunk_tokens in a pipeline (the output stage hands the loss_fn its input
    and weight): the plain loss's losses, gradients (a tied weight's summed over the two
    stages) and weights."""
    run = load_run(pipeline_losses, f"{tie}-chunked", 1)
    plain = load_run(pipeline_losses, f"{tie}-plain", 1)
    assert run["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert_equivalent(run, plain)


def test_compiled_layers_pp2(pipeline_losses):
    """model.compile=layer inside DeepSpeed's pipeline stages: the eager run's losses,
    gradients and weights."""
    run = load_run(pipeline_losses, "untied-compiled", 1)
    plain = load_run(pipeline_losses, "untied-plain", 1)
    assert run["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert_equivalent(run, plain)


@pytest.fixture(scope="module")
def zero_stages(tmp_path_factory) -> Path:
    """belief_star at TP=2 x DP=2 under ZeRO-0 (in fp32 our optimizer hook clips, with the
    norm's own counting rules: train/engine.py), -1, -2 and -3, one after another in one job."""
    return run_driver(tmp_path_factory.mktemp("zero"), 2, 1, 2, "0,1,2,3", ["belief_star"])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_tp2_dp2(reference, zero_stages, zero):
    run = load_run(zero_stages, "belief_star", zero)
    assert_equivalent(run, load_run(reference, "belief_star", 1))
