"""The training loop: `train(cfg)` reads top to bottom.

Set-up (checks, process groups, run directory, tokenizer, model + DeepSpeed engine, data
stream), then one optimizer step per iteration; logging, diagnostics and the non-finite
policy are small functions below the loop.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from belief_lm.config import Config
from belief_lm.model.gpt import padded_vocab_size
from belief_lm.parallel.setup import check_layout, init_distributed, init_model_parallel
from belief_lm.runtime import select_device
from belief_lm.train.data import batches, build_tokenizer, check_sources, train_stream
from belief_lm.train.diagnostics import belief_diagnostics
from belief_lm.train.engine import (
    Trainee,
    build_engine,
    check_engine_settings,
    grad_accumulation_steps,
    use_bf16,
)
from belief_lm.train.flops import flops_per_token, peak_tflops
from belief_lm.train.metrics import MetricsLogger
from belief_lm.train.run_dir import prepare_run_dir
from data_pipeline.tokenizer import copy_model
from launcher import env as launcher_env

log = logging.getLogger("belief_lm.train")


class NonFiniteLossError(RuntimeError):
    """Too many consecutive steps had non-finite gradients."""


@dataclass
class TrainResult:
    """What a finished run reports back (on every rank)."""

    run_dir: Path
    steps: int
    losses: dict[int, float] = field(default_factory=dict)
    """Loss (mean over the global batch) at every logged step."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps whose update was skipped because a gradient was not finite."""


def preflight(cfg: Config, world_size: int, device: torch.device) -> None:
    """Every check that needs no work, so a bad config fails before anything starts:
    the config alone first, then against this job's world size and device."""
    check_engine_settings(cfg)
    check_sources(cfg.data)
    data_parallel = check_layout(world_size, cfg.parallel.tensor, cfg.parallel.pipeline)
    grad_accumulation_steps(cfg, data_parallel)
    use_bf16(cfg.train.precision, device)


def train(cfg: Config) -> TrainResult:
    env = launcher_env.detect()
    device = select_device(cfg.run.device, env.local_rank)
    preflight(cfg, env.world_size, device)
    init_distributed(env, device, cfg.parallel.timeout_s)
    layout = init_model_parallel(cfg.parallel.tensor, cfg.parallel.pipeline)
    is_logger = dist.get_rank() == 0
    run_dir = prepare_run_dir(cfg, write=is_logger)

    tokenizer = build_tokenizer(cfg.data, cfg.run.cache_dir)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg.model, layout.tensor)
    trainee = build_engine(cfg, layout, vocab_size, device)
    stream = train_stream(cfg.data, tokenizer, cfg.model.seq_length, layout.data_rank, layout.data)
    micro_batches = TimedIterator(batches(stream, cfg.train.micro_batch_size, device))
    metrics = MetricsLogger(run_dir, cfg.run.tensorboard) if is_logger else None
    if is_logger:
        copy_model(tokenizer, run_dir / "tokenizer.model")  # the run dir is self-contained
        log.info(
            "model %s (%s attention): %s parameters, vocab %d | layout TP%d x PP%d x DP%d | "
            "%d tokens per step",
            cfg.model.name, cfg.model.attention, f"{trainee.parameters:,}", vocab_size,
            layout.tensor, layout.pipeline, layout.data,
            cfg.train.global_batch_size * cfg.model.seq_length,
        )  # fmt: skip

    result = TrainResult(run_dir=run_dir, steps=cfg.train.max_steps)
    meter = Meter(cfg, vocab_size, device, dist.get_world_size())
    for step in range(1, cfg.train.max_steps + 1):
        lr = trainee.engine.get_lr()[0]  # the rate this step uses (the scheduler moves on after)
        trainee.optimizer.skipped = None
        loss = train_step(trainee, micro_batches)
        check_finite(trainee, step, result, cfg.train.max_nonfinite_steps)
        if step % cfg.run.log_interval == 0 or step == cfg.train.max_steps:
            loss_value = _mean_over_data_parallel(loss, trainee)
            scalars = meter.scalars(step, loss_value, lr, trainee, micro_batches)
            result.losses[step] = scalars["loss"]
            if metrics is not None:
                metrics.log(step, scalars)
                log.info("step %d/%d | %s", step, cfg.train.max_steps, _format(scalars))
        if cfg.run.diagnostics_interval and step % cfg.run.diagnostics_interval == 0:
            tokens, labels = micro_batches.last  # this step's data: training is not perturbed
            stats = belief_diagnostics(trainee.engine, tokens, labels, trainee.pipelined)
            if metrics is not None:
                metrics.log(step, stats, prefix="belief", jsonl="diagnostics.jsonl")
    if metrics is not None:
        metrics.close()
    return result


def train_step(trainee: Trainee, micro_batches: Iterator) -> torch.Tensor:
    """One optimizer step over the accumulation micro-batches; returns the mean loss of
    this rank's micro-batches (a device tensor: reading it is the caller's sync)."""
    engine = trainee.engine
    if trainee.pipelined:  # 1F1B over all micro-batches, optimizer step included
        return engine.train_batch(data_iter=micro_batches)
    accumulation = engine.gradient_accumulation_steps()
    total = None
    for _ in range(accumulation):
        tokens, labels = next(micro_batches)
        loss = engine(tokens, labels)
        engine.backward(loss)  # DeepSpeed divides by the accumulation steps
        engine.step()  # optimizer + scheduler step only at the accumulation boundary
        total = loss.detach() if total is None else total + loss.detach()
    return total / accumulation


def check_finite(trainee: Trainee, step: int, result: TrainResult, limit: int) -> None:
    """Record a skipped (non-finite) step; stop after `limit` in a row. The decision was
    all-reduced inside the optimizer, so every rank stops together."""
    # None: DeepSpeed did not even call the optimizer (its own overflow check skipped it)
    if trainee.optimizer.skipped is False:
        return
    result.skipped_steps.append(step)
    streak = 1
    while step - streak in result.skipped_steps:
        streak += 1
    log.warning("step %d: non-finite gradients, update skipped (%d in a row)", step, streak)
    if streak >= limit:
        raise NonFiniteLossError(
            f"{streak} consecutive steps (up to step {step}) had non-finite gradients; "
            f"stopping (train.max_nonfinite_steps={limit})"
        )


def _mean_over_data_parallel(loss: torch.Tensor, trainee: Trainee) -> float:
    """The global batch's mean loss on every rank (the pipeline engine already averages)."""
    if not trainee.pipelined and ps.get_data_parallel_world_size() > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        loss /= ps.get_data_parallel_world_size()
    return loss.item()  # host-device sync: once per log interval, not per step


class TimedIterator:
    """Wraps an iterator, adds up the seconds spent waiting in next() and keeps the last
    item."""

    def __init__(self, iterator: Iterator):
        self.iterator, self.wait_s, self.last = iterator, 0.0, None

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self):
        start = time.perf_counter()
        self.last = next(self.iterator)
        self.wait_s += time.perf_counter() - start
        return self.last


class Meter:
    """Throughput, utilisation and memory over each logging interval."""

    def __init__(self, cfg: Config, vocab_size: int, device: torch.device, world_size: int):
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_step = flops_per_token(cfg.model, vocab_size) * self.tokens_per_step
        self.peak = peak_tflops(device, cfg.run.peak_tflops)
        self.device, self.world_size = device, world_size
        self.last_time, self.last_step, self.last_wait = time.perf_counter(), 0, 0.0

    def scalars(
        self, step: int, loss: float, lr: float, trainee: Trainee, data: TimedIterator
    ) -> dict:
        now = time.perf_counter()
        steps, elapsed = step - self.last_step, now - self.last_time
        tflops = self.flops_per_step * steps / elapsed / self.world_size / 1e12
        norm = trainee.engine.get_global_grad_norm()
        scalars = {
            "loss": loss,
            "lr": lr,
            "grad_norm": None if norm is None else float(norm),
            "tokens_per_s": self.tokens_per_step * steps / elapsed,
            "step_time_s": elapsed / steps,
            "data_wait_s": (data.wait_s - self.last_wait) / steps,
            "tflops_per_device": tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            "memory_gb": self._memory_gb(),
        }
        self.last_time, self.last_step, self.last_wait = now, step, data.wait_s
        return scalars

    def _memory_gb(self) -> float:
        """Peak GPU memory allocated since the last log, or the process's peak RSS on CPU."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _format(scalars: dict[str, float | None]) -> str:
    return " | ".join(f"{k} {'-' if v is None else f'{v:.4g}'}" for k, v in scalars.items())
