"""The training loop: `train(cfg)` reads top to bottom.

Set-up (checks, process groups, run directory, tokenizer, model + DeepSpeed engine, data
stream), then one optimizer step per iteration; logging, diagnostics and the non-finite
policy are small functions below the loop.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from belief_lm.checkpoint.store import CheckpointError
from belief_lm.config import Config
from belief_lm.model.gpt import padded_vocab_size
from belief_lm.parallel.setup import Layout, check_layout, init_distributed, init_model_parallel
from belief_lm.runtime import select_device
from belief_lm.train import checkpointing
from belief_lm.train.data import build_tokenizer, build_train_data, check_data
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
from belief_lm.train.run_dir import drop_metrics_after, prepare_run_dir
from belief_lm.train.signals import Preempted, StopRequests
from belief_lm.train.validation import validation_batches, validation_loss
from data_pipeline.loader import TrainData
from data_pipeline.tokenizer import Tokenizer, copy_model
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
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss at every evaluated step."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps whose update was skipped because a gradient was not finite."""


def preflight(cfg: Config, world_size: int, device: torch.device) -> None:
    """Every check that needs no work, so a bad config fails before anything starts:
    the config alone first, then against this job's world size and device."""
    check_engine_settings(cfg)
    check_data(cfg.data)
    data_parallel = check_layout(world_size, cfg.parallel.tensor, cfg.parallel.pipeline)
    grad_accumulation_steps(cfg, data_parallel)
    use_bf16(cfg.train.precision, device)


def train(cfg: Config) -> TrainResult:
    run = setup(cfg)
    result = TrainResult(run_dir=run.run_dir, steps=cfg.train.max_steps)
    with StopRequests() as stop:
        for step in range(run.start + 1, cfg.train.max_steps + 1):
            lr = run.trainee.engine.get_lr()[0]  # this step's rate (the schedule moves on after)
            run.trainee.optimizer.skipped = None
            loss = train_step(run.trainee, run.micro_batches)
            run.consumed += run.meter.tokens_per_step
            try:
                check_finite(run.trainee, step, result, cfg.train.max_nonfinite_steps)
            except NonFiniteLossError:
                run.save(step)  # the weights are sound: the bad updates were skipped
                raise
            if step % cfg.run.log_interval == 0 or step == cfg.train.max_steps:
                result.losses[step] = run.log(step, loss, lr)
            if run.validation_due(step):
                result.val_losses[step] = run.validate(step)
            if cfg.run.diagnostics_interval and step % cfg.run.diagnostics_interval == 0:
                run.diagnose(step)
            stopping = stop.agreed()  # a stop signal on any rank (one small all-reduce)
            if stopping or run.checkpoint_due(step):
                run.save(step)
            if stopping:
                raise Preempted(step)
    run.close()
    return result


@dataclass
class Run:
    """What a training run holds between steps, and its per-step side jobs."""

    cfg: Config
    layout: Layout
    run_dir: Path
    tokenizer: Tokenizer
    vocab_size: int
    trainee: Trainee
    data: TrainData
    """This rank's resumable micro-batch stream."""
    micro_batches: TimedIterator
    meter: Meter
    metrics: MetricsLogger | None
    validation: list
    """This rank's held-out micro-batches (empty unless train.eval_interval is set)."""
    start: int
    """The step the run resumed after (0 for a fresh run)."""
    consumed: int
    """Training tokens consumed so far (all ranks)."""

    def log(self, step: int, loss: torch.Tensor, lr: float) -> float:
        """Log this step's scalars (collective: the loss is averaged over data parallelism)
        and return the loss."""
        scalars = self.meter.scalars(
            step, _mean_over_data_parallel(loss, self.trainee), lr, self.trainee,
            self.micro_batches,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.log(step, scalars)
            log.info("step %d/%d | %s", step, self.cfg.train.max_steps, _format(scalars))
        return scalars["loss"]

    def validation_due(self, step: int) -> bool:
        interval, last = self.cfg.train.eval_interval, step == self.cfg.train.max_steps
        return bool(interval) and (step % interval == 0 or last)

    def validate(self, step: int) -> float:
        """Log the held-out loss (collective) and return it."""
        loss, tokens = validation_loss(self.trainee.engine, self.validation, self.trainee.pipelined)
        scalars = {"val_loss": loss, "val_perplexity": math.exp(loss), "val_tokens": tokens}
        if self.metrics is not None:
            self.metrics.log(step, scalars, prefix="val")
            log.info("step %d | %s", step, _format(scalars))
        return loss

    def diagnose(self, step: int) -> None:
        """Belief diagnostics on this step's last micro-batch (training is not perturbed)."""
        # middle pipeline stages never read the data: they have no micro-batch (None)
        tokens, labels = self.micro_batches.last or (None, None)
        stats = belief_diagnostics(self.trainee.engine, tokens, labels, self.trainee.pipelined)
        if self.metrics is not None:
            self.metrics.log(step, stats, prefix="belief", jsonl="diagnostics.jsonl")

    def checkpoint_due(self, step: int) -> bool:
        interval, cfg = self.cfg.checkpoint.interval, self.cfg
        last = step == cfg.train.max_steps and cfg.checkpoint.save_at_end
        return last or bool(interval and step % interval == 0)

    def save(self, step: int) -> None:
        checkpointing.save(
            self.cfg, self.trainee.engine, self.data, self.layout, step, self.consumed,
            self.vocab_size, self.tokenizer.path,
        )  # fmt: skip

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()


def setup(cfg: Config) -> Run:
    """Process groups, run directory, tokenizer, engine, data stream; resumes from a
    checkpoint when there is one (checkpoint.resume)."""
    env = launcher_env.detect()
    device = select_device(cfg.run.device, env.local_rank)
    preflight(cfg, env.world_size, device)
    init_distributed(env, device, cfg.parallel.timeout_s)
    layout = init_model_parallel(cfg.parallel.tensor, cfg.parallel.pipeline)
    is_logger = dist.get_rank() == 0
    run_dir = prepare_run_dir(cfg, write=is_logger)

    tokenizer = build_tokenizer(cfg.data, cfg.run.cache_dir)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg.model, layout.tensor)
    plan = checkpointing.plan_resume(cfg, layout)
    if plan is not None and plan.info.vocab_size != vocab_size:
        raise CheckpointError(
            f"checkpoint {plan.path} has vocabulary {plan.info.vocab_size}, this run {vocab_size}"
        )
    trainee = build_engine(cfg, layout, vocab_size, device, plan is not None and plan.other_layout)
    data = build_train_data(
        cfg.data, tokenizer, cfg.model.seq_length, cfg.train.micro_batch_size,
        layout.data_rank, layout.data, device,
    )  # fmt: skip
    start = 0 if plan is None else checkpointing.restore(plan, cfg, trainee.engine, data, layout)
    validation = []
    if cfg.train.eval_interval:
        validation = validation_batches(
            cfg.data, tokenizer, cfg.model.seq_length, cfg.train.micro_batch_size, layout,
            device, cfg.train.eval_batches,
        )  # fmt: skip
    metrics = None
    if is_logger:
        copy_model(tokenizer, run_dir / "tokenizer.model")  # the run dir is self-contained
        if plan is not None:
            drop_metrics_after(run_dir, start)  # rows a crashed run logged past its checkpoint
        metrics = MetricsLogger(run_dir, cfg.run.tensorboard)
        log.info(
            "model %s (%s attention): %s parameters, vocab %d | layout TP%d x PP%d x DP%d | "
            "%d tokens per step%s",
            cfg.model.name, cfg.model.attention, f"{trainee.parameters:,}", vocab_size,
            layout.tensor, layout.pipeline, layout.data,
            cfg.train.global_batch_size * cfg.model.seq_length,
            f" | resuming after step {start}" if start else "",
        )  # fmt: skip
    return Run(
        cfg=cfg, layout=layout, run_dir=run_dir, tokenizer=tokenizer, vocab_size=vocab_size,
        trainee=trainee, data=data, micro_batches=TimedIterator(data),
        meter=Meter(cfg, vocab_size, device, dist.get_world_size(), start), metrics=metrics,
        validation=validation, start=start,
        consumed=0 if plan is None else plan.info.consumed_tokens,
    )  # fmt: skip


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

    def __init__(
        self, cfg: Config, vocab_size: int, device: torch.device, world_size: int, start: int
    ):
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_step = flops_per_token(cfg.model, vocab_size) * self.tokens_per_step
        self.peak = peak_tflops(device, cfg.run.peak_tflops)
        self.device, self.world_size = device, world_size
        # a resumed run's first interval starts at its checkpoint's step, not at 0
        self.last_time, self.last_step, self.last_wait = time.perf_counter(), start, 0.0

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
