"""Distributed training equals single-process training, from the same initial weights
(run.seed) on the same global batches: losses, every gradient at every step, and the final
weights, within fp32 tolerance."""

from pathlib import Path

import pytest

from belief_lm.variants import VARIANTS
from tests.parallel import driver
from tests.parallel.conftest import (
    GPT2_VARIANTS,
    LAYOUT_VARIANTS,
    STABILITY_VARIANTS,
    assert_equivalent,
    assert_same_layer_signals,
    load_run,
    run_driver,
    torchrun,
)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_every_variant(reference, tp2, variant):
    """TP=2 with sequence parallelism (the default at TP > 1), ten steps: every variant's
    sequence-wide statistics (belief's inner products, Attention-BN's key means,
    Attention-SH's pools) are computed where the whole sequence is, so the single
    process's losses, gradients and weights; the hidden norms' gradients (each rank's from
    its part of the sequence) only once summed over the ranks (sum_sequence_parallel_grads).
    The per-layer signals too: each variant's largest logit over both ranks' heads, the RMS
    of the whole hidden state, each layer's gradient norm over both shards with its norms
    counted once."""
    run = load_run(tp2, f"{variant}-long", 1)
    single = load_run(reference, f"{variant}-long", 1)
    assert len(run["losses"]) == driver.LONG_STEPS
    assert_equivalent(run, single)
    assert_same_layer_signals(run, single)


@pytest.mark.parametrize("variant", GPT2_VARIANTS)
def test_sequence_parallel_gpt2_architecture_tp2(reference, tp2, variant):
    """Sequence parallelism with what the Llama architecture lacks: LayerNorm biases,
    learned position embeddings (added before the embedding's scatter) and the
    row-parallel linears' biases (added after their reduce-scatter, their gradients summed
    over the ranks): the single process's losses and gradients. The final biases, zero
    at the start and a few lr after three steps, differ by Adam's sign noise up to 3.8e-4
    of their norm (measured): bound 1e-3 for the weights. Without the sum of the
    biases' gradients their step-0 error is O(1)."""
    name = f"{variant}-gpt2"
    run, single = load_run(tp2, name, 1), load_run(reference, name, 1)
    assert "layers.0.mlp.linear_fc2.bias" in single["params"]
    assert_equivalent(run, single, weight_bound=1e-3)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_without_sequence_parallel(reference, tp2, variant):
    """parallel.sequence_parallel=false at TP=2, ten steps, every variant: the single
    process's run too, and the same run at TP=2 with sequence parallelism."""
    run = load_run(tp2, f"{variant}-nosp", 1)
    assert_equivalent(run, load_run(reference, f"{variant}-long", 1))
    assert_equivalent(run, load_run(tp2, f"{variant}-long", 1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_parallel_document_mask(reference, tp2, variant):
    """model.attention_mask=document at TP=2 (each rank's heads, the documents alike on
    both) against one process, every variant (STABILITY_VARIANTS with QK-norm and the
    z-loss as well)."""
    name = f"{variant}-documents"
    assert_equivalent(load_run(tp2, name, 1), load_run(reference, name, 1))
    causal = load_run(reference, f"{variant}-long", 1)["losses"]
    assert load_run(reference, name, 1)["losses"][0] != pytest.approx(causal[0], abs=1e-4)


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
    plain = load_run(reference, f"{variant}-long", 1)
    assert single["losses"][0] != pytest.approx(plain["losses"][0], abs=1e-4)


def test_belief_star_tp2_pp2_dp2(reference, tp2_pp2_dp2):
    """Tensor and pipeline parallel together (with data parallel and ZeRO-1 on top: the
    run the change-of-layout tests resume from, so TP=2 x PP=2 needs no run of its own),
    plain and with QK-norm and a z-loss (the z-loss the pipeline engine sums over
    micro-batches and averages over data parallelism). Each stage's per-layer signals
    reach every rank, the gradient norms too, measured inside the engine's train_batch
    before its update, where a loss-spike check sees the step's loss (so a spike's
    gradient norms are its step's)."""
    run, single = load_run(tp2_pp2_dp2, "belief_star", 1), load_run(reference, "belief_star", 1)
    assert_equivalent(run, single)
    assert_same_layer_signals(run, single)
    assert [updates for updates, _ in run["screened"]] == list(range(len(run["losses"])))
    assert [loss for _, loss in run["screened"]] == run["losses"]
    run = load_run(tp2_pp2_dp2, "belief_star-stability", 1)
    single = load_run(reference, "belief_star-stability", 1)
    assert_equivalent(run, single)
    assert run["z_losses"] == pytest.approx(single["z_losses"], rel=1e-5)


@pytest.mark.parametrize("variant", LAYOUT_VARIANTS)
def test_ten_steps_tp2_pp2_dp2(reference, tp2_pp2_dp2, variant):
    """Sequence parallelism through the pipeline's stages ([s/t, b, h] at the boundary) at
    TP=2 x PP=2 x DP=2, ten steps: one process's losses, gradients and weights."""
    name = f"{variant}-long"
    assert_equivalent(load_run(tp2_pp2_dp2, name, 1), load_run(reference, name, 1))


@pytest.mark.parametrize("variant", LAYOUT_VARIANTS)
def test_document_mask_tp2_pp2_dp2(reference, tp2_pp2_dp2, variant):
    """The document mask through pipeline stages (the boundary carrying the marks of where
    documents end, as DeepSpeed's boolean last element) at TP=2 x PP=2 x DP=2, against one
    process: belief_star (with QK-norm and the z-loss) and Attention-BN-SH (running
    statistics)."""
    name = f"{variant}-documents"
    assert_equivalent(load_run(tp2_pp2_dp2, name, 1), load_run(reference, name, 1))


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
    norm's own counting rules: train/engine.py), -1, -2 and -3, one after another in one
    job; under ZeRO-0 also on masked labels at micro-batches of 4, 2 and 1 (accumulation
    1, 2 and 4); attention_bn_sh under the document mask at every stage; under ZeRO-1 and -2
    LAYOUT_VARIANTS over driver.LONG_STEPS steps."""
    return run_driver(
        tmp_path_factory.mktemp("zero"), 2, 1, 2, "0,1,2,3", ["belief_star"],
        "--padded", "belief_star", "--padded-micro", "4,2,1", "--documents", "attention_bn_sh",
        "--long", ",".join(LAYOUT_VARIANTS), "--long-zero", "1,2",
    )  # fmt: skip


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_tp2_dp2(reference, zero_stages, zero):
    """And the per-layer gradient norms of the global batch, from ZeRO's fragments."""
    run, single = load_run(zero_stages, "belief_star", zero), load_run(reference, "belief_star", 1)
    assert_equivalent(run, single)
    assert_same_layer_signals(run, single)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_document_mask_zero_stages_tp2_dp2(reference, zero_stages, zero):
    """model.attention_mask=document at TP=2 x DP=2 under every ZeRO stage (Attention-BN-SH:
    its running statistics restart at each document): one process's losses, gradients and
    weights."""
    name = "attention_bn_sh-documents"
    assert_equivalent(load_run(zero_stages, name, zero), load_run(reference, name, 1))


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("variant", LAYOUT_VARIANTS)
def test_ten_steps_tp2_dp2(reference, zero_stages, variant, zero):
    """Sequence parallelism with data parallelism at TP=2 x DP=2 under ZeRO-1 and -2 (the
    norms' gradients summed over TP before ZeRO's reduction), ten steps: one process's
    losses, gradients and weights."""
    name = f"{variant}-long"
    assert_equivalent(load_run(zero_stages, name, zero), load_run(reference, name, 1))


@pytest.mark.parametrize("micro", [4, 2, 1])
def test_token_weighted_loss_whatever_the_split(reference, zero_stages, micro):
    """Steps whose micro-batches hold different numbers of labels (rows keeping 0 to 16,
    a padded window every fifth row), split at DP=2 (and TP=2) into micro-batches of 4 x
    accumulation 1, 2 x 2 and 1 x 4: the losses, gradients and weights of one process at
    2 x 4. Each is the step's mean over all its labels; a mean per micro-batch, averaged,
    differs with the split."""
    run = load_run(zero_stages, f"belief_star-padded-micro{micro}", 0)
    single = load_run(reference, "belief_star-padded-micro2", 1)
    assert_equivalent(run, single)
    plain = load_run(reference, "belief_star", 1)
    assert single["losses"][0] != pytest.approx(plain["losses"][0], abs=1e-4)


def test_token_weighted_loss_pipeline(reference, tp2_pp2_dp2):
    """The same steps through the pipeline engine's loss_fn (its last stage weighs each
    micro-batch by its labels) at TP=2 x PP=2 x DP=2: one process's losses and gradients."""
    run = load_run(tp2_pp2_dp2, "belief_star-padded-micro2", 1)
    assert_equivalent(run, load_run(reference, "belief_star-padded-micro2", 1))
