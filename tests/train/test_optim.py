import copy
import io
import itertools
import math

import pytest
import torch

from belief_lm.config import ConfigError, TrainConfig, load_config
from belief_lm.train.loop import train
from belief_lm.train.optim import (
    LRSchedule,
    Update,
    adamw_kernel,
    build_optimizer,
    param_groups,
)


def test_warmup_then_cosine_to_min_lr():
    schedule = LRSchedule(TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110))
    assert schedule(0) == pytest.approx(0.1)  # the first step already learns
    assert schedule(9) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)
    values = [schedule(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_decay_steps_and_no_warmup():
    schedule = LRSchedule(
        TrainConfig(lr=2.0, min_lr=0.0, warmup_steps=0, max_steps=100, decay_steps=50)
    )
    assert schedule(0) == pytest.approx(1.0)
    assert schedule(50) == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("shape", "at_half"),
    [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))],
)
def test_warmup_stable_decay(shape, at_half):
    """wsd: warmup to lr, lr held to the decay's start, then down to min_lr at decay_steps
    in the shape asked for; its values at the warmup's end, in the stable phase, at the
    decay's start, half way, at the last step and after."""
    train = TrainConfig(
        lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=100, lr_schedule="wsd",
        wsd_decay_steps=20, wsd_decay_shape=shape,
    )  # fmt: skip
    schedule = LRSchedule(train)
    assert (train.decay_start, train.decay_end) == (80, 100)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == pytest.approx(1.0)  # the warmup's last step
    assert [schedule(s) for s in (10, 50, 79, 80)] == [1.0, 1.0, 1.0, 1.0]
    assert schedule(90) == pytest.approx(0.1 + 0.9 * at_half)
    last = {"linear": 1 - 19 / 20, "cosine": 0.5 * (1 + math.cos(math.pi * 19 / 20)),
            "1-sqrt": 1 - math.sqrt(19 / 20)}[shape]  # fmt: skip
    assert schedule(99) == pytest.approx(0.1 + 0.9 * last)  # the run's last step
    assert schedule(100) == schedule(500) == pytest.approx(0.1)
    values = [schedule(s) for s in range(80, 101)]
    assert all(a > b for a, b in itertools.pairwise(values))


def test_wsd_decay_fraction_and_constant():
    """wsd_decay_fraction: the decay's share of the steps to decay_steps (default 0.2);
    constant: lr after the warmup, to the end and past it."""
    share = TrainConfig(max_steps=200, lr_schedule="wsd", wsd_decay_fraction=0.25)
    assert (share.decay_start, share.decay_end) == (150, 200)
    default = TrainConfig(max_steps=300, decay_steps=200, lr_schedule="wsd")
    assert (default.decay_start, default.decay_end) == (160, 200)
    assert LRSchedule(default)(250) == pytest.approx(default.min_lr / default.lr)
    constant = LRSchedule(TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4, lr_schedule="constant"))
    assert [constant(s) for s in (0, 3, 4, 99, 100, 10_000)] == [0.25, 1.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.wsd_decay_steps=10"], "train: wsd_decay_steps applies to lr_schedule=wsd, not"),
        (["train.lr_schedule=wsd", "train.wsd_decay_steps=10", "train.wsd_decay_fraction=0.1"],
         "both set"),
        (["train.lr_schedule=wsd", "train.wsd_decay_steps=95", "train.warmup_steps=10"],
         r"train: wsd_decay_steps: the decay \(95 steps, ending at step 100\) would start before"),
        (["train.lr_schedule=wsd", "train.wsd_decay_fraction=1.5"], "train.wsd_decay_fraction"),
        (["train.lr_schedule=linear"], "train.lr_schedule"),
        (["train.wsd_decay_shape=sqrt"], "train.wsd_decay_shape"),
    ],
)  # fmt: skip
def test_schedule_options_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.max_steps=100", *overrides])


def test_a_restored_scheduler_continues_mid_decay():
    """The scheduler's state (DeepSpeed saves its state_dict in the checkpoint, beside the
    optimizer's) is plain values that load weights-only; restored mid-decay into a fresh
    optimizer and scheduler, it continues the trace of one that never stopped."""
    train = TrainConfig(
        lr=1.0, min_lr=0.0, warmup_steps=2, max_steps=12, lr_schedule="wsd",
        wsd_decay_steps=6, wsd_decay_shape="1-sqrt",
    )  # fmt: skip

    def scheduled():
        model = torch.nn.Linear(2, 2)
        return build_optimizer(model, train, torch.device("cpu"))

    optimizer, scheduler = scheduled()
    trace = []
    for step in range(12):
        if step == 8:  # two steps into the decay
            buffer = io.BytesIO()
            torch.save((optimizer.state_dict(), scheduler.state_dict()), buffer)
        trace.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert trace[5] == 1.0 and trace[7] > trace[8] > trace[9] > trace[11] > 0
    buffer.seek(0)
    optimizer, scheduler = scheduled()
    optimizer_state, scheduler_state = torch.load(buffer, weights_only=True)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    resumed = []
    for _ in range(8, 12):
        resumed.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert resumed == trace[8:]


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    )
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {2} and len(decay["params"]) == 2
    assert {p.ndim for p in no_decay["params"]} == {1} and len(no_decay["params"]) == 3
    train = TrainConfig(lr=0.5, warmup_steps=5, weight_decay=0.1)
    optimizer, _ = build_optimizer(model, train, torch.device("cpu"))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # 0.5 x 1/5 at step 0
    # the optimizer decays each parameter as its group says: matrices only
    decayed = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decayed == {id(p): 0.1 if p.ndim >= 2 else 0.0 for p in model.parameters()}


def test_the_optimizer_tells_what_each_step_decided():
    """A vetoed step and a non-finite gradient leave the weights as they were; each step's
    decision is taken once (none before a step); the veto holds only where it is given."""
    model = torch.nn.Linear(2, 2)
    optimizer, _ = build_optimizer(model, TrainConfig(lr=0.1, warmup_steps=0), torch.device("cpu"))
    weights = [p.detach().clone() for p in model.parameters()]

    def step(grad: float, veto: bool = False) -> Update | None:
        for param in model.parameters():
            param.grad = torch.full_like(param, grad)
        with optimizer.vetoing(veto):
            optimizer.step()
        return optimizer.take_update()

    assert optimizer.take_update() is None
    assert step(1.0, veto=True) == Update(nonfinite=False, vetoed=True)
    assert optimizer.take_update() is None  # taken
    assert step(float("nan")) == Update(nonfinite=True, vetoed=False)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    assert step(1.0) == Update(nonfinite=False, vetoed=False)
    assert not any(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


@pytest.mark.parametrize(
    ("kernel", "device", "flags"),
    [
        ("auto", "cuda", {"fused": True, "foreach": False}),
        ("auto", "cpu", {"fused": False, "foreach": False}),  # torch's own CPU default
        ("fused", "cpu", {"fused": True, "foreach": False}),
        ("foreach", "cuda", {"fused": False, "foreach": True}),
        ("for_loop", "cuda", {"fused": False, "foreach": False}),
    ],
)
def test_adamw_kernel_flags(kernel, device, flags):
    assert adamw_kernel(kernel, torch.device(device)) == flags


def test_adamw_kernels_take_the_same_steps():
    """fused (torch has a CPU kernel since 2.4), foreach and for_loop: the same AdamW
    updates, with weight decay groups and the warmup schedule, to fp32 rounding."""
    torch.manual_seed(0)
    start = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)
    )
    grads = [[torch.randn_like(p) for p in start.parameters()] for _ in range(6)]
    weights = {}
    for kernel in ("for_loop", "foreach", "fused"):
        model = copy.deepcopy(start)
        cfg = TrainConfig(lr=1e-2, warmup_steps=2, max_steps=6, adamw_kernel=kernel)
        optimizer, scheduler = build_optimizer(model, cfg, torch.device("cpu"))
        assert optimizer.defaults["fused"] == (kernel == "fused")
        for step_grads in grads:
            for param, grad in zip(model.parameters(), step_grads, strict=True):
                param.grad = grad.clone()
            optimizer.step()
            scheduler.step()
        weights[kernel] = torch.cat([p.detach().flatten() for p in model.parameters()])
    initial = torch.cat([p.detach().flatten() for p in start.parameters()])
    assert (weights["for_loop"] - initial).abs().max() > 1e-2  # the steps moved the weights
    for kernel in ("foreach", "fused"):
        torch.testing.assert_close(weights[kernel], weights["for_loop"], rtol=1e-6, atol=1e-6)


def test_fused_adamw_through_deepspeed_trains_alike(tmp_path, tiny_config):
    """The option reaches the optimizer DeepSpeed's ZeRO-1 steps: same losses (fp32)."""
    losses = {}
    for kernel in ("for_loop", "fused"):
        cfg = tiny_config(
            "train.max_steps=4",
            f"train.adamw_kernel={kernel}",
            f"run.output_dir={tmp_path / kernel}",
        )
        losses[kernel] = list(train(cfg).losses.values())
    assert losses["fused"] == pytest.approx(losses["for_loop"], rel=1e-5)
    assert losses["fused"][-1] < losses["fused"][0]
