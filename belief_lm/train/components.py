"""The parts of a training run, one factory each, in the order `Trainer.build` makes them.

Before any process group: `start_run` (where this process is, its device, pre-flight and
the data's checks). Then the process grid (`join_grid`), and on it the tokenizer, the
model in its DeepSpeed engine, the data stream, a checkpoint's state, the held-out batches,
the spike detector and the metrics sinks. Each is handed what it needs (the grid, the
checkpoint to resume) and returns its part; none reads another's attributes back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from belief_lm.checkpoint.files import CheckpointError
from belief_lm.config import Config, padded_vocab_size
from belief_lm.parallel import env as process_env
from belief_lm.parallel.env import ProcessEnv
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.preflight import Preflight, ResumeFrom, preflight
from belief_lm.runtime import select_device
from belief_lm.train import branch, trainer_state
from belief_lm.train.engine import Trainee, build_trainee
from belief_lm.train.metrics import MetricsLogger
from belief_lm.train.run_dir import drop_metrics_after, record_start
from belief_lm.train.spikes import SpikeDetector
from belief_lm.train.validation import Batch, validation_batches
from data_pipeline.build import build_tokenizer, build_train_data, check_data
from data_pipeline.loader import Collective, TrainData
from data_pipeline.tokenizer import Tokenizer, copy_model

log = logging.getLogger("belief_lm.train")


@dataclass(frozen=True)
class RunStart:
    """What a run knows before any process group exists."""

    env: ProcessEnv
    """Where this process is in the job."""
    device: torch.device
    checked: Preflight
    """What pre-flight worked out: the layout's dims, accumulation, precision, the resume."""


def start_run(cfg: Config) -> RunStart:
    """This process's place and device, and every check that needs no work: pre-flight
    (refusing a bad layout, batch or resume) and the data's sources."""
    env = process_env.detect()
    device = select_device(cfg.run.device, env.local_rank)
    checked = preflight(cfg, env.world_size, device.type)
    check_data(cfg.data)
    return RunStart(env, device, checked)


def join_grid(cfg: Config, start: RunStart) -> ProcessGrid:
    """The job's process grid at pre-flight's layout, with this rank's heartbeat in the
    run's output directory (collective)."""
    return ProcessGrid.join(
        start.env, start.device, start.checked.dims, timeout_s=cfg.parallel.timeout_s,
        heartbeat_dir=cfg.run.output_dir, rank_zero_wait_s=cfg.parallel.rank_zero_wait_s,
    )  # fmt: skip


def run_tokenizer(cfg: Config, grid: ProcessGrid, resume: ResumeFrom | None) -> Tokenizer:
    """The run's tokenizer: trained (or loaded from the cache) by rank 0 first, the others
    then find it cached. A resumed run goes on with the one its checkpoint holds."""
    saved = None if resume is None else resume.path / "tokenizer.model"
    return grid.rank_zero_first(lambda: build_tokenizer(cfg.data, cfg.run.cache_dir, saved))


def checked_vocab_size(
    cfg: Config, tokenizer: Tokenizer, grid: ProcessGrid, resume: ResumeFrom | None
) -> int:
    """The embedding's rows (the tokenizer's vocabulary padded for the tensor-parallel
    split), which a checkpoint to resume must have too."""
    vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg.model, grid.layout.tensor)
    if resume is not None and resume.info.vocab_size != vocab_size:
        raise CheckpointError(
            f"checkpoint {resume.path} has vocabulary {resume.info.vocab_size}, "
            f"this run {vocab_size}"
        )
    return vocab_size


def run_trainee(
    cfg: Config, checked: Preflight, grid: ProcessGrid, vocab_size: int, device: torch.device,
    eos_id: int | None = None,
) -> Trainee:  # fmt: skip
    """The model in its DeepSpeed engine at pre-flight's precision and accumulation; a
    weights-only checkpoint (an import) gives its starting weights; `eos_id` (the
    tokenizer's EOS) is where documents end under model.attention_mask=document."""
    resume = checked.resume
    return build_trainee(
        cfg, grid, vocab_size, device, bf16=checked.bf16, accumulation=checked.grad_accumulation,
        load_universal=resume is not None and resume.other_layout,
        weights=trainer_state.weights_only(resume), eos_id=eos_id,
    )  # fmt: skip


def data_collective(grid: ProcessGrid) -> Collective:
    """How the data streams of the ranks agree each step: one all-reduce over the whole
    job (each reader's counts arrive once per tensor x pipeline replica), and the
    messages of a failed source gathered only when one failed."""
    replicas = grid.dims.tensor * grid.dims.pipeline
    return Collective(sum=grid.sum_over_job, gather=grid.gather_objects, replicas=replicas)


def train_data(
    cfg: Config, tokenizer: Tokenizer, grid: ProcessGrid, device: torch.device
) -> TrainData:
    """This rank's training steps (resumable at any layout)."""
    layout = grid.layout
    return build_train_data(
        cfg.data, tokenizer, cfg.model.seq_length, cfg.train.global_batch_size,
        cfg.train.micro_batch_size, layout.data_rank, layout.data, device,
        collective=data_collective(grid),
    )  # fmt: skip


def restore_run(
    cfg: Config, resume: ResumeFrom | None, trainee: Trainee, data: TrainData, grid: ProcessGrid
) -> int:
    """Load the checkpoint to resume (engine, RNG states, data position) and return its
    step; 0 for a fresh run. A weights-only checkpoint's weights are in the model already:
    it starts at its step with a fresh optimizer and data stream. A branch (another run's
    checkpoint) goes on with this config's schedule and optimizer settings from there."""
    if resume is None:
        return 0
    if resume.info.weights_only:
        return resume.info.step
    step = trainer_state.restore(resume, cfg, trainee.engine, grid)
    if resume.branch:
        branch.take_settings(trainee.engine, cfg.train)
    data.load_state_dict(trainer_state.load_data_state(resume))
    return step


def held_out_batches(
    cfg: Config, tokenizer: Tokenizer, grid: ProcessGrid, device: torch.device
) -> list[Batch]:
    """This rank's held-out micro-batches (none unless train.eval_interval is set)."""
    if not cfg.train.eval_interval:
        return []
    return validation_batches(
        cfg.data, tokenizer, cfg.model.seq_length, cfg.train.micro_batch_size, grid.layout,
        device, cfg.train.eval_batches,
    )  # fmt: skip


def spike_detector(cfg: Config, resume: ResumeFrom | None) -> SpikeDetector | None:
    """The loss history spikes are judged against, continued from a checkpoint's (None:
    train.spike.threshold is None; an imported model's weights come without history)."""
    if cfg.train.spike.threshold is None:
        return None
    restored = resume is not None and not resume.info.weights_only
    saved = trainer_state.load_rank_state(resume, 0) if restored else None
    return SpikeDetector(cfg.train.spike, (saved or {}).get("spikes"))


def open_metrics(
    cfg: Config, run_dir: Path, tokenizer: Tokenizer, resume: ResumeFrom | None, start: int,
    grid: ProcessGrid,
) -> MetricsLogger | None:  # fmt: skip
    """The metrics sinks, on rank 0 (None elsewhere; a W&B failure stops every rank). The
    run directory gets a copy of the tokenizer (it is self-contained) and, on a resume,
    loses the rows a crashed run logged past its checkpoint."""

    def open_sinks() -> MetricsLogger:
        copy_model(tokenizer, run_dir / "tokenizer.model")
        if resume is not None:
            drop_metrics_after(run_dir, start)
        branched = resume is not None and resume.branch  # the branch's first start
        record_start(run_dir, start, grid.world_size, branched)
        return MetricsLogger.open(cfg, run_dir, resumed=resume is not None)

    return grid.on_rank_zero(open_sinks)


def log_start(cfg: Config, grid: ProcessGrid, parameters: int, vocab_size: int, start: int) -> None:
    """The run's first line (on rank 0): model, layout, tokens per step, resume."""
    if grid.rank != 0:
        return
    layout = grid.layout
    log.info(
        "model %s (%s attention): %s parameters, vocab %d | layout TP%d x PP%d x DP%d | "
        "%d tokens per step%s",
        cfg.model.name, cfg.model.attention, f"{parameters:,}", vocab_size,
        layout.tensor, layout.pipeline, layout.data,
        cfg.train.global_batch_size * cfg.model.seq_length,
        f" | resuming after step {start}" if start else "",
    )  # fmt: skip
