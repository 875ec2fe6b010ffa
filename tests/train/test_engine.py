"""belief_lm.train.engine: the loss weighted by tokens. A step's loss and gradient are the
mean over every label of the step, however its micro-batches split them (across
data-parallel ranks too: tests/parallel/test_equivalence.py, the padded runs)."""

import dataclasses

import pytest
import torch

from belief_lm.config import load_config
from belief_lm.model.gpt import BeliefLM
from belief_lm.model.loss import IGNORE_INDEX
from tests.jobs import MICRO, ROOT
from tests.models import trainee_for

VOCAB, SEQ = 256, 32


def unequal_step() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels [4, SEQ] of one step: rows 0-1 fully labelled, row 2 with 2
    labels (one masked among them), row 3 a padded window (no label, as at an epoch's
    end): split in two micro-batches, 64 labels against 2."""
    rows = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))
    tokens, labels = rows[:, :-1].clone(), rows[:, 1:].clone()
    labels[2, 3:] = IGNORE_INDEX
    labels[2, 1] = IGNORE_INDEX
    labels[3] = IGNORE_INDEX
    tokens[3] = 0  # the loader's padding
    return tokens, labels


def config(micro: int = 4, z_loss: float = 0.0, *overrides: str):
    """The micro config at SEQ and VOCAB, 4 sequences a step of `micro`, then `overrides`."""
    return load_config(
        ROOT / MICRO,
        [f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}", f"train.z_loss={z_loss}",
         f"train.micro_batch_size={micro}", "train.global_batch_size=4", *overrides],
    )  # fmt: skip


def one_step(grid, micro: int, z_loss: float) -> tuple[float, dict, float]:
    """(the step's logged loss, the gradients before the update, the z-loss reported) of
    the micro config's model at micro-batch `micro` (accumulation 4 / micro) on
    unequal_step."""
    trainee = trainee_for(config(micro, z_loss), grid, VOCAB)
    engine, grads = trainee.engine, {}
    take_step = engine._take_model_step

    def capture_then_step(*args, **kwargs):
        from deepspeed.utils import safe_get_full_grad

        for name, param in engine.module.named_parameters():  # ZeRO's partitions gathered
            grads[name] = safe_get_full_grad(param).clone()
        return take_step(*args, **kwargs)

    engine._take_model_step = capture_then_step
    tokens, labels = unequal_step()
    batches = zip(tokens.split(micro), labels.split(micro), strict=True)
    done = trainee.train_step(batches)
    loss = trainee.global_mean(done.loss)
    z = trainee.global_mean(done.reported["z_loss"])
    engine.destroy()
    return loss, grads, z


def whole_batch(z_loss: float) -> tuple[float, dict, float]:
    """The same model's mean over the step's 66 labels in one forward, its gradient and
    its z-loss term."""
    cfg = config(z_loss=z_loss)
    model = BeliefLM(cfg.model, VOCAB, seed=cfg.run.seed, z_loss=z_loss)
    loss = model(*unequal_step())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, float(model.last_z_loss)


def test_a_step_weighs_every_label_alike(single_process_group):
    """Micro-batches of 64 and 2 labels (accumulation 2), and of 32, 32, 2 and 0 labels
    (accumulation 4): the step's logged loss, its z-loss and every gradient are those of
    the whole step's mean over its 66 labels; a mean per micro-batch, averaged, gives the
    2-label micro-batch the weight of the 64-label one (and the empty one a weight too)."""
    loss, grads, z = whole_batch(z_loss=0.01)
    assert z > 0
    for micro in (2, 1):
        step_loss, step_grads, step_z = one_step(single_process_group, micro, z_loss=0.01)
        assert step_loss == pytest.approx(loss, rel=1e-5)
        assert step_z == pytest.approx(z, rel=1e-5)
        assert step_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(step_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero0_alone_skips_deepspeeds_reduction_bit_for_bit(single_process_group, precision):
    """At ZeRO-0 with one data-parallel rank there is nothing to reduce: DeepSpeed's
    all-reduce of the gradients (flattened, scaled by 1, reduced over one rank, copied back)
    is skipped, and 3 steps of 2 micro-batches leave the same losses and weights, bit for
    bit, as with it (bf16: DeepSpeed's bf16 engine, on the CPU as bench_trainee builds it)."""
    from bench.common import bench_trainee

    cfg = config(2, 0.0, "parallel.zero_stage=0", f"train.precision={precision}")
    tokens, labels = unequal_step()
    runs = []
    for reduces in (True, False):
        trainee = bench_trainee(cfg, single_process_group, VOCAB, torch.device("cpu"))
        assert not trainee.reduces_gradients  # what build_trainee decides here
        trainee = dataclasses.replace(trainee, reduces_gradients=reduces)
        engine, reductions = trainee.engine, []
        fallback = engine.buffered_allreduce_fallback
        engine.buffered_allreduce_fallback = lambda *a, _f=fallback, _r=reductions, **k: _r.append(
            _f(*a, **k)
        )
        losses = []
        for _ in range(3):
            batches = zip(tokens.split(2), labels.split(2), strict=True)
            losses.append(trainee.train_step(batches).loss.item())
        assert len(reductions) == (3 if reduces else 0)
        runs.append((losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}))
        engine.destroy()
    (reduced_losses, reduced), (losses, weights) = runs
    assert losses == reduced_losses
    assert all(torch.equal(weights[name], reduced[name]) for name in reduced)


def test_zero0_clips_once_and_reports_the_norm_before(single_process_group):
    """At ZeRO-0 in fp32 our optimizer clips (DeepSpeed would drop the norm): once, and the
    engine reports the norm before clipping, also when a plain torch AdamW exists in the
    process (making one patches AdamW.step, which our update calls, with torch's hook
    runner: a clipping step pre-hook ran twice and reported the clipped norm)."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # patches AdamW.step
    cfg = config(4, 0.0, "parallel.zero_stage=0", "train.grad_clip=0.01")
    _, grads, _ = whole_batch(z_loss=0.0)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    assert norm > 10 * cfg.train.grad_clip
    trainee = trainee_for(cfg, single_process_group, VOCAB)
    trainee.train_step(iter([unequal_step()]))
    assert trainee.engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-4)
    trainee.engine.destroy()


def test_a_step_alone_calls_no_collective(single_process_group, monkeypatch):
    """One process at ZeRO-0 (every group of one rank): a step with the z-loss and
    clipping calls no all-reduce (the cross entropy's maximum and sums, the clipping norm,
    the non-finite verdict: collectives.all_reduce_unless_alone), and its loss is the
    whole batch's."""
    cfg = config(4, 0.01, "parallel.zero_stage=0")
    trainee = trainee_for(cfg, single_process_group, VOCAB)
    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: calls.append(a))
    done = trainee.train_step(iter([unequal_step()]))
    trainee.engine.destroy()
    assert calls == []
    assert done.loss.item() == pytest.approx(whole_batch(z_loss=0.01)[0], rel=1e-6)


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_bf16_nonfinite_step_is_skipped_whole_after_one_pass(single_process_group, zero_stage):
    """In bf16 at ZeRO-0/1/2 a step with a NaN or an infinite gradient in one tensor is
    skipped as a whole (every parameter group: ZeRO steps them apart), found by our one
    multi-tensor pass (compat.one_pass_overflow_check) rather than DeepSpeed's dozen
    kernels per tensor; the next finite step updates (the weights it moves by more than
    bf16 resolves: not a norm's weights of 1.0 at ZeRO-0)."""
    from bench.common import bench_trainee

    cfg = config(4, 0.0, f"parallel.zero_stage={zero_stage}", "train.precision=bf16")
    trainee = bench_trainee(cfg, single_process_group, VOCAB, torch.device("cpu"))
    engine, per_tensor = trainee.engine, []
    checker = getattr(engine.optimizer, "overflow_checker", engine.optimizer)  # ZeRO-0's
    checker._has_inf_or_nan = lambda *a: per_tensor.append(a)  # DeepSpeed's own, per tensor
    poison = [1.0]
    last = list(engine.module.parameters())[-1]  # in the no-decay group, stepped last
    last.register_hook(lambda grad: grad * poison[0])

    def step(factor: float) -> tuple[bool, list[bool]]:
        poison[0] = factor
        before = [p.detach().clone() for p in engine.module.parameters()]
        done = trainee.train_step(iter([unequal_step()]))
        after = engine.module.parameters()
        return done.nonfinite, [not torch.equal(b, p) for b, p in zip(before, after, strict=True)]

    step(1.0)  # (the warm-up's first step, at a learning rate of nearly 0)
    for factor in (float("nan"), float("inf")):
        nonfinite, changed = step(factor)
        assert nonfinite and not any(changed), factor
    nonfinite, changed = step(1.0)
    assert not nonfinite and sum(changed) > len(changed) // 2
    assert per_tensor == []
    engine.destroy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_grad_norm_in_one_pass_is_deepspeeds(single_process_group, precision):
    """ZeRO-1's gradient norm from one multi-tensor pass (compat.one_pass_grad_norm) is
    the norm DeepSpeed's own per-tensor get_grad_norm_direct gives on the same gradients,
    and the step clips by it (grad_clip below the norm)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from bench.common import bench_trainee

    cfg = config(
        4, 0.0, "parallel.zero_stage=1", f"train.precision={precision}", "train.grad_clip=0.01"
    )
    trainee = bench_trainee(cfg, single_process_group, VOCAB, torch.device("cpu"))
    zero, norms = trainee.engine.optimizer, []
    assert "get_grad_norm_direct" in vars(zero)  # ours, installed over DeepSpeed's
    ours = zero.get_grad_norm_direct
    deepspeeds = DeepSpeedZeroOptimizer.get_grad_norm_direct.__get__(zero)
    zero.get_grad_norm_direct = lambda *a, **k: norms.append((ours(*a), deepspeeds(*a))) or (
        norms[-1][0]
    )  # fmt: skip
    trainee.train_step(iter([unequal_step()]))
    assert norms, "the step took no norm"
    for mine, theirs in norms:
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=0)
    reported = trainee.engine.get_global_grad_norm()
    assert float(reported) > 10 * cfg.train.grad_clip  # so the step clipped
    trainee.engine.destroy()
