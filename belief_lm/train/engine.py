"""The DeepSpeed engine around our model: ZeRO, gradient accumulation, clipping, bf16.

We hand DeepSpeed a ready optimizer (torch AdamW) and scheduler; the engine owns the
accumulation boundary, clipping, the optimizer/scheduler steps, and checkpoints.
"""

from __future__ import annotations

import torch

from belief_lm.config import Config
from belief_lm.train.optim import build_optimizer


def use_bf16(precision: str, device: torch.device) -> bool:
    """Resolve train.precision (auto: bf16 on GPU, fp32 on CPU)."""
    if precision == "bf16" and device.type != "cuda":
        raise ValueError("train.precision=bf16 needs a GPU; use fp32 or auto on CPU")
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


def grad_accumulation_steps(cfg: Config, data_parallel: int) -> int:
    """Micro-batches per optimizer step on each rank: global / (micro x data-parallel)."""
    per_step = cfg.train.micro_batch_size * data_parallel
    if cfg.train.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size ({cfg.train.micro_batch_size}) x data-parallel size "
            f"({data_parallel})"
        )
    return cfg.train.global_batch_size // per_step


def deepspeed_config(cfg: Config, data_parallel: int, bf16: bool) -> dict:
    """DeepSpeed's JSON config, derived from ours (users never write it by hand)."""
    return {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": grad_accumulation_steps(cfg, data_parallel),
        # DeepSpeed defaults clipping to 1.0 when unset: always state it.
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
    }


def build_engine(
    model: torch.nn.Module, cfg: Config, data_parallel: int, device: torch.device, mpu=None
):
    """deepspeed.initialize with our optimizer, schedule and config; returns the engine.
    `mpu` describes tensor/data-parallel groups to DeepSpeed (None without TP)."""
    import deepspeed

    optimizer, scheduler = build_optimizer(model, cfg.train, device)
    bf16 = use_bf16(cfg.train.precision, device)
    ds_config = deepspeed_config(cfg, data_parallel, bf16)
    if cfg.parallel.zero_stage == 0 and not bf16:
        # Here DeepSpeed would clip but drop the norm; clip in a pre-step hook instead.
        ds_config["gradient_clipping"] = 0.0
        optimizer.register_step_pre_hook(_clip_and_record_norm(cfg.train.grad_clip, mpu))
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config, mpu=mpu
    )
    return engine


def _clip_and_record_norm(max_norm: float, mpu):
    """Optimizer pre-step hook: clip the (already data-parallel reduced) gradients and leave
    the pre-clip norm in `optimizer._global_grad_norm`, where DeepSpeed's engine reads it
    for get_global_grad_norm()."""
    from deepspeed.runtime.utils import clip_grad_norm_, get_flattened_grad_norm

    def hook(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if max_norm > 0:
            optimizer._global_grad_norm = clip_grad_norm_(params, max_norm, mpu=mpu)
        else:
            optimizer._global_grad_norm = get_flattened_grad_norm(params, mpu=mpu)

    return hook
