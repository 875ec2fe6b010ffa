"""AdamW with decoupled weight decay on matrices only, and warmup + cosine learning rate."""

from __future__ import annotations

import math

import torch

from belief_lm.config import TrainConfig


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


class WarmupCosine:
    """Learning-rate multiplier after `step` optimizer steps: linear warmup to 1 over
    warmup_steps (the first step already uses 1/warmup_steps), then a cosine from 1 to
    min_lr/lr at decay_steps, then flat. A class, not a lambda, so schedulers pickle."""

    def __init__(self, train: TrainConfig):
        self.warmup = train.warmup_steps
        self.decay_end = max(train.decay_steps or train.max_steps, self.warmup + 1)
        self.floor = train.min_lr / train.lr

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / (self.decay_end - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    model: torch.nn.Module, train: TrainConfig, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """torch's AdamW (fused kernel on GPU) and its LambdaLR schedule."""
    optimizer = torch.optim.AdamW(
        param_groups(model, train.weight_decay),
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.eps,
        fused=device.type == "cuda",
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(train))
