"""The training loop: `train(cfg)` reads top to bottom.

`train` checks the run before any process starts (`components.start_run`: pre-flight), joins
the process grid (`components.join_grid`) and builds the Trainer from its parts
(`Trainer.build`, each part made by a factory of `belief_lm.train.components`). The loop,
`run_steps`, then repeats `train_step`, which returns what the step did (`StepResult`), and,
when due, `log`, `validate`, `diagnose` and `save`. The engine's step is
`belief_lm.train.engine`, meters and sinks are `belief_lm.train.metrics`, checkpoints
`belief_lm.train.trainer_state`; what a person watching sees is `progress`, loss spikes
`spikes`, the per-rank compute times `ranks`, a profiled stretch of steps `profile`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from belief_lm.checkpoint import store
from belief_lm.config import Config
from belief_lm.errors import DataStop, NonFiniteLossError, Preempted, SpikeStop
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.parallel.peers import end_child_processes, is_lost_peer
from belief_lm.preflight import Preflight
from belief_lm.train import components, downstream, layer_signals, trainer_state
from belief_lm.train.diagnostics import belief_diagnostics
from belief_lm.train.engine import Trainee
from belief_lm.train.metrics import Meter, MetricsLogger, format_scalars
from belief_lm.train.profile import StepProfiler
from belief_lm.train.progress import Progress
from belief_lm.train.ranks import ForwardTimer, rank_spread
from belief_lm.train.run_dir import prepare_run_dir
from belief_lm.train.signals import StopRequests
from belief_lm.train.spikes import LossCheck, Spike, SpikeDetector
from belief_lm.train.validation import Batch, validation_loss
from data_pipeline.failures import DataFault
from data_pipeline.loader import TrainData
from data_pipeline.tokenizer import Tokenizer

log = logging.getLogger("belief_lm.train")


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
    spikes: list[int] = field(default_factory=list)
    """Steps whose loss was a spike (train.spike)."""
    task_scores: dict[int, dict[str, float] | None] = field(default_factory=dict)
    """train.eval_tasks scores at every step they ran (on rank 0; None elsewhere)."""


@dataclass(frozen=True)
class StepResult:
    """What one training step did: the same on every rank, but for `loss` and `last_batch`."""

    step: int
    """The optimizer steps done, this one included."""
    loss: torch.Tensor
    """This rank's mean loss (a device tensor: reading it syncs)."""
    mean_loss: float | None
    """The loss averaged over the global batch, where the spike check computed it."""
    lr: float
    """The step's learning rate."""
    reported: dict[str, torch.Tensor]
    """What the model computed beside the loss (z_loss with train.z_loss): this rank's, as
    `loss` (engine.StepOutcome.reported)."""
    spike: Spike | None
    """The loss spike it was, if it was one."""
    spike_layers: tuple[dict, list] | None
    """A spike's per-layer gradient norms and the layers whose norm grew most."""
    nonfinite: bool
    """Whether its update was skipped for a non-finite gradient."""
    vetoed: bool
    """Whether its update was skipped because its loss was a spike (train.spike.action=skip)."""
    tokens: int
    """Training tokens the step took (all ranks)."""
    data_wait_s: float
    """Seconds this rank waited for the step's data."""
    last_batch: Batch
    """This rank's last micro-batch of the step (for diagnostics)."""


def train(cfg: Config, stop: StopRequests | None = None) -> TrainResult:
    """Run `cfg` to train.max_steps. Stop signals are caught from here on, or by `stop`, the
    caller's active StopRequests (the CLI catches them from its first moment)."""
    requests = StopRequests() if stop is None else contextlib.nullcontext(stop)
    with requests as stop:
        start = components.start_run(cfg)  # pre-flight: before any process group
        # a collective that fails because a peer is silent or gone raises peers.PeerLost
        with components.join_grid(cfg, start).watching() as grid:
            trainer = Trainer.build(cfg, start, grid)
            try:
                return run_steps(trainer, stop)
            except RuntimeError as err:
                if is_lost_peer(err):  # the step cannot finish: no orderly stop
                    end_child_processes()
                raise
            finally:
                trainer.close()  # loader workers stopped while stop signals are still caught


def run_steps(trainer: Trainer, stop: StopRequests) -> TrainResult:
    """The steps from the trainer's to train.max_steps, each followed by what is due: the
    log, validation, diagnostics, a stop request, a checkpoint."""
    cfg, grid = trainer.cfg, trainer.grid
    result = TrainResult(run_dir=trainer.run_dir, steps=cfg.train.max_steps)
    while trainer.step < cfg.train.max_steps:
        try:
            done = trainer.train_step()
        except DataFault as fault:  # raised on every rank, before the step trained
            if trainer.step > trainer.start:
                trainer.save()  # the last completed step, data position included
            raise DataStop(f"{fault}; stopped after step {trainer.step}") from None
        grid.beat(done.step)
        if done.nonfinite:
            skipped_in_a_row(result, done.step, cfg.train.max_nonfinite_steps, trainer)
        if trainer.due(cfg.run.log_interval):
            result.losses[done.step] = trainer.log(done)
        if done.spike is not None:
            spiked_in_a_row(result, done, trainer)
        if trainer.due(cfg.train.eval_interval):
            result.val_losses[done.step] = trainer.validate()
        if trainer.due(cfg.run.diagnostics_interval, at_end=False):
            trainer.diagnose(done.last_batch)
        stopping = stop.agreed(grid)  # a stop signal on any rank (one small all-reduce)
        trainer.checkpoints.poll()  # publishes a background save all ranks wrote
        if stopping or trainer.checkpoint_due():
            evaluating = not stopping and downstream.due(cfg.train, done.step)
            checkpoint = trainer.save(wait=stopping or evaluating)
            if evaluating:
                result.task_scores[done.step] = trainer.evaluate_tasks(checkpoint)
        if stopping:
            raise Preempted(done.step)
    trainer.checkpoints.wait()  # the last save, if it is still being written
    return result


def skipped_in_a_row(result: TrainResult, step: int, limit: int, trainer: Trainer) -> None:
    """Record a skipped (non-finite) update; after `limit` in a row, save and stop. The
    decision was all-reduced inside the optimizer, so every rank stops together."""
    result.skipped_steps.append(step)
    streak = 1
    while step - streak in result.skipped_steps:
        streak += 1
    log.warning("step %d: non-finite gradients, update skipped (%d in a row)", step, streak)
    if streak >= limit:
        trainer.save()  # the weights are sound: the bad updates were skipped
        raise NonFiniteLossError(
            f"{streak} consecutive steps (up to step {step}) had non-finite gradients; "
            f"stopping (train.max_nonfinite_steps={limit})"
        )


def spiked_in_a_row(result: TrainResult, done: StepResult, trainer: Trainer) -> None:
    """Record a loss spike; with train.spike.action=stop, after max_in_row in a row, save
    and stop (every rank judged the same global loss, so every rank stops together)."""
    spike = done.spike
    result.spikes.append(spike.step)
    trainer.report_spike(spike, done.vetoed, done.spike_layers)
    cfg = trainer.cfg.train.spike
    if cfg.action == "stop" and trainer.spikes.in_a_row >= cfg.max_in_row:
        trainer.save()
        raise SpikeStop(
            f"{trainer.spikes.in_a_row} loss spikes in a row (up to step {spike.step}, loss "
            f"{spike.loss:.4g} against a median of {spike.median:.4g}); checkpoint saved, "
            f"stopping (train.spike.action=stop, max_in_row={cfg.max_in_row})"
        )


@dataclass
class Trainer:
    """A run between steps: its parts, and the steps a training loop takes with them."""

    cfg: Config
    checked: Preflight
    """What pre-flight worked out (the resume: the checkpoint verified and taken)."""
    grid: ProcessGrid
    run_dir: Path
    tokenizer: Tokenizer
    vocab_size: int
    trainee: Trainee
    """The model in DeepSpeed's engine (`trainee.engine`)."""
    data: TrainData
    """This rank's training steps (resumable at any layout)."""
    meter: Meter
    metrics: MetricsLogger | None
    """The sinks, on the rank that logs (None elsewhere)."""
    validation: list[Batch]
    """This rank's held-out micro-batches (empty unless train.eval_interval is set)."""
    step: int
    """Optimizer steps done (the checkpoint's step right after a resume)."""
    start: int
    """The step this process started from."""
    consumed_tokens: int
    """Training tokens consumed so far (all ranks)."""
    spikes: SpikeDetector | None
    """The loss history spikes are judged against (None: train.spike.threshold is None)."""
    timer: ForwardTimer
    """This rank's seconds in the model's forward passes (slow ranks show in its spread)."""
    profiler: StepProfiler
    checkpoints: store.Checkpointer
    """Writes this run's checkpoints (now, or in the background: checkpoint.async_save)."""
    progress: Progress | None
    """The console's progress line or bar, on the rank that logs (None elsewhere)."""
    data_wait_s: float = 0.0
    """Seconds spent waiting for data, in all."""
    gradients: layer_signals.GradientWatch | None = None
    """Per-layer gradient norms (diagnostics steps and spikes)."""

    @classmethod
    def build(cls, cfg: Config, start: components.RunStart, grid: ProcessGrid) -> Trainer:
        """The run's parts on `grid` (see belief_lm.train.components); resumes from a
        checkpoint when there is one (checkpoint.resume)."""
        device, checked = start.device, start.checked
        # the checkpoint's files read through once between the ranks, before any work
        resume = trainer_state.verified_resume(checked.resume, cfg, checked.dims)
        checked = dataclasses.replace(checked, resume=resume)
        if cfg.train.eval_tasks:
            downstream.check_tasks(cfg.train.eval_tasks, grid)  # lm-eval resolves them
        run_dir = prepare_run_dir(cfg, write=grid.rank == 0)
        tokenizer = components.run_tokenizer(cfg, grid, resume)
        vocab_size = components.checked_vocab_size(cfg, tokenizer, grid, resume)
        trainee = components.run_trainee(cfg, checked, grid, vocab_size, device, tokenizer.eos_id)
        data = components.train_data(cfg, tokenizer, grid, device)
        checkpoints = trainer_state.checkpointer(cfg, trainee.engine, grid)  # before a load
        step = components.restore_run(cfg, resume, trainee, data, grid)
        metrics = components.open_metrics(cfg, run_dir, tokenizer, resume, step, grid)
        components.log_start(cfg, grid, trainee.parameters, vocab_size, step)
        logs = grid.rank == 0
        return cls(
            cfg=cfg, checked=checked, grid=grid, run_dir=run_dir, tokenizer=tokenizer,
            vocab_size=vocab_size, trainee=trainee, data=data,
            meter=Meter(cfg, vocab_size, device, grid.world_size, step), metrics=metrics,
            validation=components.held_out_batches(cfg, tokenizer, grid, device),
            step=step, start=step,
            consumed_tokens=0 if resume is None else resume.info.consumed_tokens,
            spikes=components.spike_detector(cfg, resume),
            timer=ForwardTimer(trainee.engine.module, device),
            profiler=StepProfiler(cfg.run.profile, run_dir, device, grid.rank),
            checkpoints=checkpoints,
            progress=Progress(cfg.train.max_steps, step) if logs else None,
        )  # fmt: skip

    def train_step(self) -> StepResult:
        """One optimizer step; returns what it did. Raises DataFault (on every rank, before
        training) if a data source failed."""
        step = self.step + 1
        with self.profiler.step(step):
            waited = time.perf_counter()
            batches = self.data.next_step()  # the whole step, or a DataFault on every rank
            wait_s = time.perf_counter() - waited
            self.data_wait_s += wait_s
            lr = self.trainee.engine.get_lr()[0]  # this step's rate (the schedule moves on)
            screen = None if self.spikes is None else functools.partial(self.judge_loss, step)
            self.watch_gradients(step)
            with self.timer.measuring():
                outcome = self.trainee.train_step(iter(batches), screen)
            if self.gradients is not None:
                self.gradients.step_done()
        self.step = step
        self.consumed_tokens += self.meter.tokens_per_step
        check = outcome.check
        return StepResult(
            step=step, loss=outcome.loss, mean_loss=None if check is None else check.mean,
            lr=lr, reported=outcome.reported, spike=None if check is None else check.spike,
            spike_layers=None if check is None else check.layers,
            nonfinite=outcome.nonfinite,
            vetoed=outcome.vetoed, tokens=self.meter.tokens_per_step, data_wait_s=wait_s,
            last_batch=batches[-1],
        )  # fmt: skip

    def judge_loss(self, step: int, loss: torch.Tensor) -> LossCheck:
        """Step `step`'s loss against the running estimate, before its update (collective
        over data parallelism: every rank judges the same global mean); a spike's per-layer
        gradient norms are taken then, every rank alike."""
        mean = self.trainee.global_mean(loss)  # host-device sync, every step
        spike = self.spikes.check(step, mean)
        skip = spike is not None and self.cfg.train.spike.action == "skip"
        layers = None
        if spike is not None and self.gradients is not None:
            layers = self.gradients.spike_report()  # before the update
        return LossCheck(mean, spike, skip, layers)

    def watch_gradients(self, step: int) -> None:
        """Measure the per-layer gradient norms before the update of `step` if it is a
        diagnostics step (with a pipeline, inside train_batch: Trainee.before_update)."""
        trainee = self.trainee
        if self.gradients is None:
            self.gradients = layer_signals.GradientWatch(trainee.engine.module)
        interval = self.cfg.run.diagnostics_interval
        due = bool(interval) and step % interval == 0
        trainee.before_update = self.gradients.measure if due else None

    def report_spike(self, spike: Spike, skipped: bool, layers: tuple[dict, list] | None) -> None:
        """A metrics row (prefix `spike`) and a warning line for a loss spike; `skipped`:
        its update was skipped; `layers`: its per-layer gradient norms and the layers whose
        norm grew most (LossCheck.layers)."""
        if self.metrics is None:
            return
        norms, grown = layers or ({}, [])
        scalars = spike.scalars(skipped) | norms | {f"grew/{name}": r for name, r in grown}
        self.metrics.log(spike.step, scalars, prefix="spike")
        log.warning(
            "step %d: loss spike %.4g, %.1f deviations above the median %.4g of the last %d "
            "steps%s%s", spike.step, spike.loss, spike.score, spike.median, spike.history,
            "; update skipped" if skipped else "",
            "; gradient norm grew most in " + ", ".join(f"{n} (x{r:.3g})" for n, r in grown)
            if grown else "",
        )  # fmt: skip

    def due(self, interval: int, at_end: bool = True) -> bool:
        """Whether something done every `interval` steps (0: never) is due at this step;
        `at_end`: also at the run's last step."""
        last = at_end and self.step == self.cfg.train.max_steps
        return bool(interval) and (self.step % interval == 0 or last)

    def checkpoint_due(self) -> bool:
        interval, cfg = self.cfg.checkpoint.interval, self.cfg
        last = self.step == cfg.train.max_steps and cfg.checkpoint.save_at_end
        return last or bool(interval and self.step % interval == 0)

    def log(self, done: StepResult) -> float:
        """Log the scalars of step `done` (collective: the loss is averaged over data
        parallelism) and return its loss."""
        norm = self.trainee.engine.get_global_grad_norm()
        mean = self.trainee.global_mean(done.loss) if done.mean_loss is None else done.mean_loss
        forward_s = self.timer.take() / (self.step - self.meter.last_step)  # per step
        scalars = self.meter.scalars(
            self.step, mean, done.lr, None if norm is None else float(norm), self.data_wait_s
        )
        for name, value in done.reported.items():  # z_loss (collective)
            scalars[name] = self.trainee.global_mean(value)
        scalars.update(self.data.stats())  # data health, summed over the ranks
        if self.grid.world_size > 1:  # a straggler shows in the spread (one all-gather)
            scalars.update(rank_spread(forward_s))
        if self.metrics is not None:
            self.metrics.log(self.step, scalars)
            self.progress.update(self.step, scalars)
        return scalars["loss"]

    def validate(self) -> float:
        """Log the held-out loss (collective) and return it."""
        trainee = self.trainee
        loss, tokens = validation_loss(
            trainee.engine, self.validation, self.grid.data_group, trainee.pipelined
        )
        scalars = {"val_loss": loss, "val_perplexity": math.exp(loss), "val_tokens": tokens}
        if self.metrics is not None:
            self.metrics.log(self.step, scalars, prefix="val")
            log.info("step %d | %s", self.step, format_scalars(scalars))
        return loss

    def evaluate_tasks(self, checkpoint: Path) -> dict[str, float] | None:
        """Run train.eval_tasks on `checkpoint` and log their scores (collective)."""
        cfg = self.cfg
        scores = downstream.evaluate(cfg.train, checkpoint, cfg.run.device, self.run_dir, self.grid)
        if self.metrics is not None:
            self.metrics.log(self.step, scores, prefix="downstream")
            log.info("step %d | %s", self.step, format_scalars(scores))
        return scores

    def diagnose(self, batch: Batch) -> None:
        """Belief diagnostics on `batch`, a micro-batch of this step (training is not
        perturbed)."""
        tokens, labels = batch
        trainee = self.trainee
        stats = belief_diagnostics(trainee.engine, tokens, labels, trainee.pipelined)
        signals = {k: stats.pop(k) for k in list(stats) if layer_signals.is_forward_signal(k)}
        signals.update({} if self.gradients is None else self.gradients.reference)
        if self.metrics is not None:
            self.metrics.log(self.step, stats, prefix="belief", jsonl="diagnostics.jsonl")
            self.metrics.log(self.step, signals, prefix="layers")  # metrics.jsonl

    def state_dict(self) -> dict:
        """This rank's state beyond the engine's and the data's: its RNG states, and the
        loss history spikes are judged against."""
        state = trainer_state.rank_state(self.grid.layout)
        if self.spikes is not None:
            state["spikes"] = self.spikes.state_dict()
        return state

    def save(self, wait: bool = True) -> Path:
        """Checkpoint this step (collective), with the data position of every rank. `wait`:
        return once it is published (with checkpoint.async_save, else once it is in host
        memory: `checkpoints.poll` publishes it at a later step)."""
        return trainer_state.save(
            self.cfg, self.checkpoints, self.state_dict(), self.grid.layout, self.step,
            self.consumed_tokens, self.vocab_size, self.tokenizer.path,
            trainer_state.data_state(self.data), wait,
        )  # fmt: skip

    def close(self) -> None:
        self.checkpoints.close()  # writes in flight end (published only if waited for)
        self.profiler.close()
        self.data.close()
        if self.metrics is not None:
            self.progress.close()
            self.metrics.close()
