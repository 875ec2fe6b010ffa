"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule
(warmup, then cosine, warmup-stable-decay or constant)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.profiler import record_function

from belief_lm import compat
from belief_lm.config import TrainConfig
from belief_lm.parallel.collectives import all_reduce_unless_alone


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on parameters of two or more dimensions (matrices, embeddings); none
    on biases and norm gains."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "cosine": lambda done: 0.5 * (1 + math.cos(math.pi * done)),
    "linear": lambda done: 1 - done,
    "1-sqrt": lambda done: 1 - math.sqrt(done),
}
"""How far above the floor the rate is (1 to 0) when a share `done` of the decay is done."""


class LRSchedule:
    """Learning-rate multiplier after `step` optimizer steps (train.lr_schedule): linear
    warmup to 1 over warmup_steps (the first step already uses 1/warmup_steps); 1 until
    the decay starts (cosine: at the warmup's end; wsd: its stable phase's end; constant:
    never); from 1 down to min_lr/lr at decay_end in the decay's shape; then flat.

    A class of plain numbers and a name, not a lambda: LambdaLR's state_dict keeps its
    attributes (DeepSpeed saves it in the checkpoint, which loads weights-only) and a resume
    restores them. The attribute names are WarmupCosine's, which this replaced (warmup,
    decay_end, floor), so its checkpoints resume."""

    def __init__(self, train: TrainConfig):
        self.warmup = train.warmup_steps
        self.decay_start, self.decay_end = train.decay_start, train.decay_end
        self.floor = 1.0 if train.lr_schedule == "constant" else train.min_lr / train.lr
        self.shape = train.wsd_decay_shape if train.lr_schedule == "wsd" else "cosine"

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step < self.decay_start:
            return 1.0
        if step >= self.decay_end:
            return self.floor
        done = (step - self.decay_start) / (self.decay_end - self.decay_start)
        return self.floor + (1 - self.floor) * DECAY_SHAPES[self.shape](done)


@dataclass(frozen=True)
class Update:
    """What an optimizer step decided, alike on every rank."""

    nonfinite: bool
    """A rank held a non-finite gradient: nothing was updated."""
    vetoed: bool
    """A rank asked to skip the update (`GuardedAdamW.vetoing`)."""

    @property
    def skipped(self) -> bool:
        """Whether nothing was updated (for either reason)."""
        return self.nonfinite or self.vetoed


class GradientClip(Protocol):
    """How GuardedAdamW clips the gradients before an update (belief_lm.train.engine's
    ClipByGlobalNorm: where DeepSpeed does not clip)."""

    def clip(self, params: list[torch.nn.Parameter], norms: list[torch.Tensor]) -> float:
        """Clip the gradients of `params`, given their 2-norms; return the norm clipped by."""


class GuardedAdamW(torch.optim.AdamW):
    """torch's AdamW that skips an update, on every rank together, when any rank holds a
    non-finite gradient (a non-finite loss makes its gradients non-finite) or any rank
    steps it `vetoing`; with `clip`, it clips the gradients first and hands the norm to
    DeepSpeed's engine (its get_global_grad_norm(): compat.report_grad_norm).

    DeepSpeed calls step() on every rank at each optimizer step (ZeRO calls it on its flat
    fp32 partitions, once per parameter group), so the decision is one all-reduce of two
    flags over the world, after the gradients were reduced and before anything is
    updated. DeepSpeed drops what step() returns: `take_update` tells the caller instead.
    The check and the clipping share one pass over the gradients (their per-tensor norms).

    The clipping is part of step() rather than a step pre-hook: torch runs an optimizer's
    hooks around every step() of a class it has patched, and AdamW.step (called here as
    super().step()) is patched as soon as any plain AdamW exists in the process, which
    would clip twice and report the clipped norm.
    """

    def __init__(self, params, clip: GradientClip | None = None, **adamw):
        super().__init__(params, **adamw)
        self.clip = clip
        self._veto = False
        self._update: Update | None = None

    @contextlib.contextmanager
    def vetoing(self, veto: bool) -> Iterator[None]:
        """Skip the updates of the step() calls made inside if `veto` (a loss spike with
        train.spike.action=skip); it holds for every call: ZeRO steps each parameter group
        separately."""
        self._veto = veto
        try:
            yield
        finally:
            self._veto = False

    def take_update(self) -> Update | None:
        """What the last step() call since the previous take decided (every call of one
        optimizer step decides alike); None if none was made, as DeepSpeed's own overflow
        check may decide."""
        update, self._update = self._update, None
        return update

    @torch.no_grad()
    def step(self, closure=None):
        with record_function("guard"):  # a phase of a profiled step
            params = [p for group in self.param_groups for p in group["params"]]
            params = [p for p in params if p.grad is not None]
            norms = compat.norms([p.grad for p in params])  # one pass over the gradients
        if self.clip is not None:
            with record_function("clip"):
                compat.report_grad_norm(self, self.clip.clip(params, norms))
        with record_function("guard"):
            device = norms[0].device if norms else "cpu"
            flags = torch.tensor([0.0, float(self._veto)], device=device)  # [non-finite, veto]
            if norms:  # torch.nn.utils.get_total_norm of the gradients, finite or not
                total = torch.linalg.vector_norm(torch.stack(norms))
                flags[0] = torch.isfinite(total).logical_not()
            all_reduce_unless_alone(flags, dist.ReduceOp.MAX)
            nonfinite, vetoed = flags.tolist()  # host-device sync, once per optimizer step
            self._update = Update(nonfinite=bool(nonfinite), vetoed=bool(vetoed))
        if self._update.skipped:
            return None
        with record_function("optimizer"):
            return super().step(closure)


def adamw_kernel(kernel: str, device: torch.device) -> dict[str, bool]:
    """torch AdamW's `fused` / `foreach` flags for train.adamw_kernel on `device` (auto:
    the fused kernel on GPU; on CPU the for-loop path that torch picks there by default)."""
    if kernel == "auto":
        kernel = "fused" if device.type == "cuda" else "for_loop"
    return {"fused": kernel == "fused", "foreach": kernel == "foreach"}


def build_optimizer(
    model: torch.nn.Module,
    train: TrainConfig,
    device: torch.device,
    clip: GradientClip | None = None,
) -> tuple[GuardedAdamW, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (train.adamw_kernel) that skips non-finite and vetoed steps, clipping first
    with `clip`, and its LambdaLR schedule (train.lr_schedule)."""
    optimizer = GuardedAdamW(
        param_groups(model, train.weight_decay),
        clip,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
        **adamw_kernel(train.adamw_kernel, device),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule(train))
