import itertools
import math

import pytest
import torch

from belief_lm.config import TrainConfig
from belief_lm.train.optim import WarmupCosine, build_optimizer, param_groups


def test_warmup_then_cosine_to_min_lr():
    schedule = WarmupCosine(TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110))
    assert schedule(0) == pytest.approx(0.1)  # the first step already learns
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)
    values = [schedule(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_decay_steps_and_no_warmup():
    schedule = WarmupCosine(
        TrainConfig(lr=2.0, min_lr=0.0, warmup_steps=0, max_steps=100, decay_steps=50)
    )
    assert schedule(0) == pytest.approx(1.0)
    assert schedule(50) == pytest.approx(0.0)


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    )
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {2} and len(decay["params"]) == 2
    assert {p.ndim for p in no_decay["params"]} == {1} and len(no_decay["params"]) == 3
    optimizer, _ = build_optimizer(model, TrainConfig(lr=0.5, warmup_steps=5), torch.device("cpu"))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # 0.5 x 1/5 at step 0
