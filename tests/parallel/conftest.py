"""Running torchrun jobs from tests: always under a timeout, output kept for failures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from belief_lm.train import layer_signals
from tests.jobs import ROOT, job_env, run_job, torchrun_command


def torchrun(nproc: int, *args: str, timeout: int = 600, env: dict | None = None):
    """Run `torchrun --nproc_per_node=nproc args...` from the repo root; kill it after
    `timeout` seconds (a crashed gloo rank would otherwise leave the others waiting)."""
    return run_job(torchrun_command(nproc, *args), timeout, cwd=ROOT, env=job_env(env))


def run_driver(
    out_dir: Path, tp: int, pp: int, dp: int, zero: int | str, variants: list[str], *options: str
) -> Path:
    """Run tests/parallel/driver.py at a layout (`zero`: a stage, or stages "1,2,3");
    returns its output directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = torchrun(
        tp * pp * dp, "tests/parallel/driver.py", str(out_dir), str(tp), str(pp), str(zero),
        ",".join(variants), *options,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return out_dir


STABILITY_VARIANTS = ["belief_star", "attention_bn"]
"""Variants trained with QK-norm and a z-loss (driver.STABILITY) in the equivalence jobs:
the one with most weights, and the one that recentres the normalized queries and keys."""
LAYOUT_VARIANTS = ["belief_star", "attention_bn_sh"]
"""Variants trained driver.LONG_STEPS steps at TP=2 x DP=2 (ZeRO-1 and -2) and at TP=2 x
PP=2 x DP=2: the one with most weights, and the one with every running statistic."""
GPT2_VARIANTS = ["belief_star"]
"""Variants also trained at the GPT-2 architecture (driver.VARIATIONS: LayerNorm biases,
learned positions, row-parallel biases) in the TP=1 and TP=2 jobs."""


def driver_lists() -> tuple[str, ...]:
    """Every variant, STABILITY_VARIANTS and GPT2_VARIANTS as the driver's comma lists."""
    from belief_lm.variants import VARIANTS

    return tuple(",".join(names) for names in (VARIANTS, STABILITY_VARIANTS, GPT2_VARIANTS))


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """Single-process (TP=PP=DP=1) records of belief_star (the run the other layouts' jobs
    are held to), of every variant over driver.LONG_STEPS steps (--long) and under the
    document mask, of STABILITY_VARIANTS with QK-norm and a z-loss (the plain loss; their
    document-masked runs with both as well), of GPT2_VARIANTS at the GPT-2 architecture,
    and belief_star's on masked labels (driver --padded: micro-batches of unequal label
    counts, accumulation 4)."""
    every, stability, gpt2 = driver_lists()
    return run_driver(
        tmp_path_factory.mktemp("ref"), 1, 1, 1, 1, ["belief_star"], "--long", every,
        "--documents", every, "--stability", stability, "--padded", "belief_star", "--gpt2", gpt2,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tp2(tmp_path_factory) -> Path:
    """TP=2 records of belief_star (its weights for the TP=1 logits check) and, over
    driver.LONG_STEPS steps, of every variant with sequence parallelism (the default) and
    without it (--long, --no-sp); of every variant under the document mask, of
    STABILITY_VARIANTS with QK-norm and a z-loss over loss chunks, and of GPT2_VARIANTS at
    the GPT-2 architecture (one torchrun: start-up dominates on CPU)."""
    every, stability, gpt2 = driver_lists()
    return run_driver(
        tmp_path_factory.mktemp("tp2"), 2, 1, 1, 1, ["belief_star"], "--long", every,
        "--no-sp", every, "--documents", every, "--stability", stability, "--chunk", "13",
        "--gpt2", gpt2,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tp2_pp2_dp2(tmp_path_factory) -> Path:
    """belief_star records at TP=2 x PP=2 x DP=2 (ZeRO-1), checkpointed after its last step
    (8 processes: one run serves the equivalence and the change-of-layout tests), with
    QK-norm and a z-loss over loss chunks (the z-loss reported through the pipeline
    engine; the chunks over the output stage's all-gathered sequence), and
    belief_star's (with QK-norm and the z-loss too) and attention_bn_sh's under the
    document mask, belief_star's on masked labels (the pipeline's loss_fn weighted by
    tokens), and LAYOUT_VARIANTS' over driver.LONG_STEPS steps."""
    out = tmp_path_factory.mktemp("tp2pp2dp2")
    documents = ["--documents", "belief_star,attention_bn_sh"]
    return run_driver(
        out, 2, 2, 2, 1, ["belief_star"], "--save-at", "3", "--stability", "belief_star",
        "--chunk", "13", *documents, "--padded", "belief_star",
        "--long", ",".join(LAYOUT_VARIANTS),
    )  # fmt: skip


def load_run(out_dir: Path, variant: str, zero: int) -> dict:
    """Merge all ranks' records: losses from rank 0, gradients and parameters from every
    stage (pipeline stages hold different parameters)."""
    files = sorted(out_dir.glob(f"{variant}-zero{zero}-rank*.pt"))
    assert files, f"no results for {variant} in {out_dir}"
    records = [torch.load(f, weights_only=False) for f in files]
    keys = ("losses", "grad_norms", "z_losses", "diagnostics", "layer_grad_norms", "screened")
    merged = {key: records[0][key] for key in keys}
    merged.update(grads=[], params={})
    for step in range(len(records[0]["grads"])):
        merged["grads"].append({k: v for r in records for k, v in r["grads"][step].items()})
    for record in records:
        merged["params"].update(record["params"])
        assert record["losses"] == pytest.approx(merged["losses"], abs=0), "ranks disagree"
        assert record["diagnostics"] == merged["diagnostics"], "ranks log different signals"
        steps = zip(record["layer_grad_norms"], merged["layer_grad_norms"], strict=True)
        for norms, first in steps:
            assert norms == pytest.approx(first, rel=1e-12), "ranks hold different grad norms"
    return merged


def assert_same_layer_signals(run: dict, reference: dict) -> None:
    """The per-layer signals (layer_signals.py) and belief diagnostics of `run` are one
    process's: of the same first weights on data-parallel rank 0's probe batch (each data-
    parallel rank measures its own; the others' must not leak in), the largest pre-softmax
    logit of every layer (the max over the heads of all tensor-parallel ranks), the RMS of
    each layer's whole output and the diagnostics' TP-summed ratios and cosines, within
    fp32 rounding (measured <= 2e-6 relative); and each step's per-layer gradient norms
    (shards over TP summed, replicated weights counted once, whole gradients under ZeRO)
    within the bounds of the gradients (assert_equivalent); every layer's on every rank
    (with a pipeline: each stage's layers, measured inside the engine's step, on all)."""
    signals, expected = run["diagnostics"], reference["diagnostics"]
    assert signals.keys() == expected.keys()
    assert {k.split("/")[1] for k in signals} >= set(layer_signals.FORWARD)
    for key, value in expected.items():
        assert signals[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    norms = reference["layer_grad_norms"]
    assert len(norms) == len(reference["grads"])
    for grads, measured in zip(reference["grads"], norms, strict=True):  # one process's
        layers = {}
        for name, grad in grads.items():
            if name.startswith("layers."):
                number = int(name.split(".")[1]) + 1
                layers[number] = layers.get(number, 0.0) + grad.double().square().sum()
        direct = {f"layer{n}/{layer_signals.GRAD_NORM}": float(v.sqrt()) for n, v in layers.items()}
        assert measured == pytest.approx(direct, rel=1e-6)
    assert len(run["layer_grad_norms"]) == len(norms)
    for step, (measured, expected) in enumerate(zip(run["layer_grad_norms"], norms, strict=True)):
        bound = 1e-5 if step == 0 else 3e-4
        assert measured == pytest.approx(expected, rel=bound), f"step {step}"


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """||value - reference|| / ||reference|| (0 when both are 0)."""
    scale = reference.double().norm()
    diff = (value.double() - reference.double()).norm()
    return float(diff / scale) if scale > 0 else float(diff)


def assert_equivalent(
    run: dict, reference: dict, first_step_exact: bool = True, weight_bound: float = 3e-4
) -> None:
    """Same losses, gradients (every parameter, every step) and final weights.

    Bounds are per parameter, on the norm of the difference relative to the reference.
    Step 0's gradients come from identical weights, so only fp32 rounding separates them
    (unless `first_step_exact` is False: a run resumed after a few Adam steps)
    (measured ~5e-7): bound 1e-5. Each AdamW update then turns rounding noise in
    near-zero gradient elements into weight differences of up to 2 x lr (its first step
    is ~lr x sign(g)), measured at 1e-5..8e-5 after a few steps: bound 3e-4 (`weight_bound`
    for the final weights: weights that start at zero, biases, are only a few lr large
    after three steps, so that noise is larger relative to them). A real
    error (a wrong reduction, an unsynchronised tied weight, mis-partitioned optimizer
    state) is O(1) at step 0 or O(lr)-per-element after it, orders of magnitude above.
    """
    assert run["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    # the clipping norm: TP-replicated weights and a pipeline's tied copy counted once
    if first_step_exact:
        assert run["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=1e-5)
    assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=3e-4)
    assert len(run["grads"]) == len(reference["grads"])
    for step, (grads, ref_grads) in enumerate(zip(run["grads"], reference["grads"], strict=True)):
        assert grads.keys() == ref_grads.keys(), f"step {step}: parameter names differ"
        bound = 1e-5 if step == 0 and first_step_exact else 3e-4
        for name, ref in ref_grads.items():
            error = relative_error(grads[name], ref)
            assert error < bound, f"step {step} gradient of {name}: relative error {error:.2e}"
    assert run["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        error = relative_error(run["params"][name], ref)
        assert error < weight_bound, f"final {name}: relative error {error:.2e}"
