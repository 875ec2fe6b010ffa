"""The training loop: `train(cfg)` reads top to bottom.

Set-up (checks, process groups, run directory, tokenizer, model, DeepSpeed engine, data
stream), then one optimizer step per iteration with logging every run.log_interval steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from belief_lm.config import Config
from belief_lm.model.gpt import BeliefLM, count_parameters, padded_vocab_size
from belief_lm.parallel.setup import check_layout, init_distributed, init_model_parallel
from belief_lm.runtime import select_device
from belief_lm.train.data import build_tokenizer, build_train_data, check_data
from belief_lm.train.engine import build_engine, grad_accumulation_steps, use_bf16
from belief_lm.train.metrics import MetricsLogger
from belief_lm.train.run_dir import prepare_run_dir
from data_pipeline.tokenizer import copy_model
from launcher import env as launcher_env

log = logging.getLogger("belief_lm.train")


@dataclass
class TrainResult:
    """What a finished run reports back (on every rank)."""

    run_dir: Path
    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    """Loss at every logged step."""


def preflight(cfg: Config, world_size: int, device: torch.device) -> None:
    """Every check that needs no work, so a bad config fails before anything starts."""
    data_parallel = check_layout(world_size, cfg.parallel.tensor, cfg.parallel.pipeline)
    grad_accumulation_steps(cfg, data_parallel)
    use_bf16(cfg.train.precision, device)
    check_data(cfg.data)
    if cfg.parallel.pipeline > 1:
        raise ValueError("parallel.pipeline > 1 is not implemented yet")
    if cfg.parallel.tensor > 1:
        raise ValueError("parallel.tensor > 1 is not implemented yet")


def train(cfg: Config) -> TrainResult:
    env = launcher_env.detect()
    device = select_device(cfg.run.device, env.local_rank)
    preflight(cfg, env.world_size, device)
    init_distributed(env, device)
    layout = init_model_parallel(cfg.parallel.tensor, cfg.parallel.pipeline)
    is_logger = dist.get_rank() == 0
    run_dir = prepare_run_dir(cfg, write=is_logger)

    tokenizer = build_tokenizer(cfg.data, cfg.run.cache_dir)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg.model, layout.tensor)
    model = BeliefLM(cfg.model, vocab_size, layout.tensor, seed=cfg.run.seed).to(device)
    n_params = count_parameters(model)  # before ZeRO-3 partitions the weights away
    engine = build_engine(model, cfg, layout.data, device)
    micro_batches = build_train_data(
        cfg.data,
        tokenizer,
        cfg.model.seq_length,
        cfg.train.micro_batch_size,
        layout.data_rank,
        layout.data,
        device,
    )
    metrics = MetricsLogger(run_dir, cfg.run.tensorboard) if is_logger else None
    if is_logger:
        copy_model(tokenizer, run_dir / "tokenizer.model")  # the run dir is self-contained
        log.info(
            "model %s (%s attention): %s parameters, vocab %d; %d tokens per step",
            cfg.model.name,
            cfg.model.attention,
            f"{n_params:,}",
            vocab_size,
            cfg.train.global_batch_size * cfg.model.seq_length,
        )

    result = TrainResult(run_dir=run_dir, steps=cfg.train.max_steps)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    last_time, last_step = time.perf_counter(), 0
    for step in range(1, cfg.train.max_steps + 1):
        lr = engine.get_lr()[0]  # the rate this step uses (the scheduler moves on after it)
        loss = train_step(engine, micro_batches)
        if step % cfg.run.log_interval and step != cfg.train.max_steps:
            continue
        loss_value = loss.item()  # host-device sync: once per log interval, not per step
        now = time.perf_counter()
        scalars = {
            "loss": loss_value,
            "lr": lr,
            "grad_norm": _to_float(engine.get_global_grad_norm()),
            "tokens_per_s": tokens_per_step * (step - last_step) / (now - last_time),
        }
        last_time, last_step = now, step
        result.losses[step] = loss_value
        if metrics is not None:
            metrics.log(step, scalars)
            log.info("step %d/%d | %s", step, cfg.train.max_steps, _format(scalars))
    if metrics is not None:
        metrics.close()
    return result


def train_step(engine, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One optimizer step over gradient_accumulation_steps micro-batches; returns the mean
    micro-batch loss (a device tensor: reading it is the caller's sync)."""
    accumulation = engine.gradient_accumulation_steps()
    total = None
    for _ in range(accumulation):
        tokens, labels = next(micro_batches)
        loss = engine(tokens, labels)
        engine.backward(loss)  # DeepSpeed divides by the accumulation steps
        engine.step()  # optimizer + scheduler step only at the accumulation boundary
        total = loss.detach() if total is None else total + loss.detach()
    return total / accumulation


def _format(scalars: dict[str, float | None]) -> str:
    return " | ".join(f"{k} {'-' if v is None else f'{v:.4g}'}" for k, v in scalars.items())


def _to_float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if torch.is_tensor(value) else value)
