"""bench/step_overhead.py: its plain PyTorch model has exactly the shapes of belief-lm's
(the same parameters, preset by preset), and both loops step side by side, profiled by
the phases belief-lm's step labels."""

from __future__ import annotations

import math

import pytest
import torch

from belief_lm.model.gpt import BeliefLM
from belief_lm.model.loss import IGNORE_INDEX, lm_loss
from belief_lm.parallel.gather import count_model_parameters
from bench.step_overhead import (
    ATTENTIONS,
    PHASES,
    PRESETS,
    PlainLM,
    comparison_config,
    side_by_side,
    torch_cross_entropy,
)

SMALL = ["model.num_layers=1", "model.seq_length=32"]


def config(preset: str, attention: str, *extra: str):
    path, overrides, _ = PRESETS[preset]
    return comparison_config(path, [*overrides, *SMALL, *extra], attention, "fp32", 2)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_plain_model_has_belief_lms_parameters(single_process_group, preset, attention):
    """Norms, biases, positions, GQA, SwiGLU, tied or untied head, belief_star's W^s: the
    same count for every preset is the same shapes (a missing bias or a doubled head
    would change it)."""
    cfg = config(preset, attention).model
    plain = sum(p.numel() for p in PlainLM(cfg, cfg.vocab_size).parameters())
    assert plain == count_model_parameters(BeliefLM(cfg, cfg.vocab_size))


def test_side_by_side_steps_and_profiles_both_loops(single_process_group):
    """ZeRO-0: our clipping hook (at ZeRO 1-3 DeepSpeed's optimizer clips: "rest")."""
    cfg = config(
        "tiny", "belief_star", "model.hidden_size=64", "model.vocab_size=256",
        "parallel.zero_stage=0",
    )  # fmt: skip
    out = side_by_side(cfg, single_process_group, torch.device("cpu"), 1, 2, profile_steps=1)
    for loop in ("plain", "belief_lm"):
        assert len(out[loop]["step_times_s"]) == 2 and len(out[loop]["losses"]) == 3
        # both are language models of this vocabulary, initialised small: ln(vocab) at first
        assert out[loop]["losses"][0] == pytest.approx(math.log(256), abs=0.1)
    assert out["ratio"] == out["belief_lm"]["median_step_s"] / out["plain"]["median_step_s"]
    ours, plain = out["profile"]["belief_lm"], out["profile"]["plain"]
    assert all(ours["phases_s"][phase] > 0 for phase in PHASES), ours["phases_s"]
    assert plain["phases_s"]["guard"] == 0 and plain["phases_s"]["backward"] > 0
    assert sum(ours["phases_s"].values()) == pytest.approx(ours["step_s"])
    assert ours["top_ops"] and all(op["self_s"] >= 0 for op in ours["top_ops"])


def test_torch_loss_is_belief_lms_loss(single_process_group):
    """--torch-loss measures the same loss: F.cross_entropy over [seq, batch, vocab]
    logits is lm_loss's value and gradient, ignored labels left out; a z-loss refused."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 3, 50, generator=gen)
    labels = torch.randint(50, (3, 8), generator=gen)
    labels[1, 2:] = IGNORE_INDEX
    grads = []
    for loss_of in (lm_loss, torch_cross_entropy):
        leaf = logits.clone().requires_grad_()
        loss = loss_of(leaf, labels).loss
        loss.backward()
        grads.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    with pytest.raises(SystemExit, match="z_loss"):
        torch_cross_entropy(logits, labels, z_loss=0.01)
