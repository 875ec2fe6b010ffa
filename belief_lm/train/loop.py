"""The training loop: `train(cfg)` reads top to bottom.

`Trainer.build` sets a run up (pre-flight checks, process groups, run directory,
tokenizer, model in its DeepSpeed engine, data stream, resume); the loop then repeats
`train_step` and, when due, `log`, `validate`, `diagnose` and `save`. The engine's step is
`belief_lm.train.engine`, meters and sinks are `belief_lm.train.metrics`, checkpoints
`belief_lm.train.trainer_state`; what a person watching sees is `progress`, loss spikes
`spikes`, the per-rank compute times `ranks`, a profiled stretch of steps `profile`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from belief_lm.checkpoint import store
from belief_lm.checkpoint.files import CheckpointError
from belief_lm.config import Config, padded_vocab_size
from belief_lm.errors import DataStop, NonFiniteLossError, Preempted, SpikeStop
from belief_lm.parallel import env as process_env
from belief_lm.parallel import peers
from belief_lm.parallel.collectives import on_rank_zero, rank_zero_first
from belief_lm.parallel.dims import Layout
from belief_lm.parallel.setup import init_distributed, init_model_parallel
from belief_lm.preflight import Preflight, preflight
from belief_lm.runtime import select_device
from belief_lm.train import branch, downstream, layer_signals, trainer_state
from belief_lm.train.diagnostics import belief_diagnostics
from belief_lm.train.engine import TrainEngine, build_engine
from belief_lm.train.metrics import Meter, MetricsLogger, format_scalars
from belief_lm.train.profile import StepProfiler
from belief_lm.train.progress import Progress
from belief_lm.train.ranks import ForwardTimer, rank_spread
from belief_lm.train.run_dir import drop_metrics_after, prepare_run_dir, record_start
from belief_lm.train.signals import StopRequests
from belief_lm.train.spikes import Spike, SpikeDetector
from belief_lm.train.validation import validation_batches, validation_loss
from data_pipeline.build import build_tokenizer, build_train_data, check_data
from data_pipeline.failures import DataFault
from data_pipeline.loader import Collective, TrainData
from data_pipeline.tokenizer import Tokenizer, copy_model

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


def train(cfg: Config, stop: StopRequests | None = None) -> TrainResult:
    """Run `cfg` to train.max_steps. Stop signals are caught from here on, or by `stop`, the
    caller's active StopRequests (the CLI catches them from its first moment)."""
    requests = StopRequests() if stop is None else contextlib.nullcontext(stop)
    # a collective that fails because a peer is silent or gone raises peers.PeerLost
    with requests as stop, peers.watching():
        trainer = Trainer.build(cfg)
        result = TrainResult(run_dir=trainer.run_dir, steps=cfg.train.max_steps)
        try:
            while trainer.step < cfg.train.max_steps:
                try:
                    loss = trainer.train_step()
                except DataFault as fault:  # raised on every rank, before the step trained
                    if trainer.step > trainer.start:
                        trainer.save()  # the last completed step, data position included
                    raise DataStop(f"{fault}; stopped after step {trainer.step}") from None
                step = trainer.step
                peers.beat(step)
                if trainer.engine.update_skipped:
                    skipped_in_a_row(result, step, cfg.train.max_nonfinite_steps, trainer)
                if trainer.due(cfg.run.log_interval):
                    result.losses[step] = trainer.log(loss)
                if trainer.spike is not None:
                    spiked_in_a_row(result, trainer.spike, trainer)
                if trainer.due(cfg.train.eval_interval):
                    result.val_losses[step] = trainer.validate()
                if trainer.due(cfg.run.diagnostics_interval, at_end=False):
                    trainer.diagnose()
                stopping = stop.agreed()  # a stop signal on any rank (one small all-reduce)
                trainer.checkpoints.poll()  # publishes a background save all ranks wrote
                if stopping or trainer.checkpoint_due():
                    evaluating = not stopping and downstream.due(cfg.train, step)
                    checkpoint = trainer.save(wait=stopping or evaluating)
                    if evaluating:
                        result.task_scores[step] = trainer.evaluate_tasks(checkpoint)
                if stopping:
                    raise Preempted(step)
            trainer.checkpoints.wait()  # the last save, if it is still being written
        except RuntimeError as err:
            if peers.is_lost_peer(err):  # the step cannot finish: no orderly stop
                peers.end_child_processes()
            raise
        finally:
            trainer.close()  # loader workers stopped while stop signals are still caught
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


def spiked_in_a_row(result: TrainResult, spike: Spike, trainer: Trainer) -> None:
    """Record a loss spike; with train.spike.action=stop, after max_in_row in a row, save
    and stop (every rank judged the same global loss, so every rank stops together)."""
    result.spikes.append(spike.step)
    trainer.report_spike(spike)
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
    plan: Preflight
    layout: Layout
    run_dir: Path
    tokenizer: Tokenizer
    vocab_size: int
    engine: TrainEngine
    data: TrainData
    """This rank's training steps (resumable at any layout)."""
    meter: Meter
    metrics: MetricsLogger | None
    """The sinks, on the rank that logs (None elsewhere)."""
    validation: list
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
    spike: Spike | None = None
    """The last step's loss spike, if it was one."""
    spike_layers: tuple[dict, list] | None = None
    """The last spike's per-layer gradient norms and the layers whose norm grew most."""
    step_loss: float | None = None
    """The last step's global mean loss, when spike detection already computed it."""
    lr: float = 0.0
    """The learning rate of the last step."""
    data_wait_s: float = 0.0
    """Seconds spent waiting for data, in all."""
    last_batch: tuple | None = None
    """The last micro-batch trained on (for diagnostics)."""
    gradients: layer_signals.GradientWatch | None = None
    """Per-layer gradient norms (diagnostics steps and spikes; none with a pipeline)."""

    @classmethod
    def build(cls, cfg: Config) -> Trainer:
        """Pre-flight checks, process groups, run directory, tokenizer, engine, data stream;
        resumes from a checkpoint when there is one (checkpoint.resume)."""
        env = process_env.detect()
        device = select_device(cfg.run.device, env.local_rank)
        plan = preflight(cfg, env.world_size, device.type)
        check_data(cfg.data)
        init_distributed(env, device, cfg.parallel.timeout_s)
        peers.start(cfg.run.output_dir, cfg.parallel.timeout_s, cfg.parallel.rank_zero_wait_s)
        layout = init_model_parallel(cfg.parallel.tensor, cfg.parallel.pipeline)
        # the checkpoint's files read through once between the ranks, before any work
        resume = trainer_state.verified_resume(plan.resume, cfg, plan.dims)
        plan = dataclasses.replace(plan, resume=resume)
        if cfg.train.eval_tasks:
            downstream.check_tasks(cfg.train.eval_tasks)  # lm-eval resolves them (rank 0)
        is_logger = dist.get_rank() == 0
        run_dir = prepare_run_dir(cfg, write=is_logger)

        # rank 0 trains (or loads) the tokenizer first; the others then find it cached. A
        # resumed run goes on with the one its checkpoint holds.
        resume = plan.resume
        saved = None if resume is None else resume.path / "tokenizer.model"
        tokenizer = rank_zero_first(lambda: build_tokenizer(cfg.data, cfg.run.cache_dir, saved))
        vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg.model, layout.tensor)
        if resume is not None and resume.info.vocab_size != vocab_size:
            raise CheckpointError(
                f"checkpoint {resume.path} has vocabulary {resume.info.vocab_size}, "
                f"this run {vocab_size}"
            )
        other_layout = resume is not None and resume.other_layout
        weights = trainer_state.weights_only(resume)  # an imported model: its weights alone
        engine = build_engine(
            cfg, layout, vocab_size, device, bf16=plan.bf16, accumulation=plan.grad_accumulation,
            load_universal=other_layout, weights=weights, eos_id=tokenizer.eos_id,
        )  # fmt: skip
        data = build_train_data(
            cfg.data, tokenizer, cfg.model.seq_length, cfg.train.global_batch_size,
            cfg.train.micro_batch_size, layout.data_rank, layout.data, device,
            collective=data_collective(),
        )  # fmt: skip
        start = 0 if resume is None else resume.info.step
        checkpoints = trainer_state.checkpointer(cfg, engine.deepspeed)  # before a load: it reads
        if resume is not None and weights is None:
            start = trainer_state.restore(resume, cfg, engine.deepspeed, layout)
            if resume.branch:  # another run's checkpoint: this config's schedule from here
                branch.take_settings(engine.deepspeed, cfg.train)
            data.load_state_dict(trainer_state.load_data_state(resume))
        validation = []
        if cfg.train.eval_interval:
            validation = validation_batches(
                cfg.data, tokenizer, cfg.model.seq_length, cfg.train.micro_batch_size, layout,
                device, cfg.train.eval_batches,
            )  # fmt: skip
        spikes = None
        if cfg.train.spike.threshold is not None:
            restored = resume is not None and weights is None  # (imported weights: no history)
            saved = trainer_state.load_rank_state(resume, 0) if restored else None
            spikes = SpikeDetector(cfg.train.spike, (saved or {}).get("spikes"))

        def open_sinks() -> MetricsLogger:  # on rank 0; a W&B failure stops every rank
            copy_model(tokenizer, run_dir / "tokenizer.model")  # the run dir is self-contained
            if resume is not None:
                drop_metrics_after(run_dir, start)  # rows a crashed run logged past its save
            branched = resume is not None and resume.branch  # the branch's first start
            record_start(run_dir, start, dist.get_world_size(), branched)
            return MetricsLogger.open(cfg, run_dir, resumed=resume is not None)

        metrics = on_rank_zero(open_sinks)
        if is_logger:
            log.info(
                "model %s (%s attention): %s parameters, vocab %d | layout TP%d x PP%d x DP%d | "
                "%d tokens per step%s",
                cfg.model.name, cfg.model.attention, f"{engine.parameters:,}", vocab_size,
                layout.tensor, layout.pipeline, layout.data,
                cfg.train.global_batch_size * cfg.model.seq_length,
                f" | resuming after step {start}" if start else "",
            )  # fmt: skip
        return cls(
            cfg=cfg, plan=plan, layout=layout, run_dir=run_dir, tokenizer=tokenizer,
            vocab_size=vocab_size, engine=engine, data=data,
            meter=Meter(cfg, vocab_size, device, dist.get_world_size(), start), metrics=metrics,
            validation=validation, step=start, start=start,
            consumed_tokens=0 if resume is None else resume.info.consumed_tokens,
            spikes=spikes, timer=ForwardTimer(engine.deepspeed.module, device),
            profiler=StepProfiler(cfg.run.profile, run_dir, device, dist.get_rank()),
            checkpoints=checkpoints,
            progress=Progress(cfg.train.max_steps, start) if is_logger else None,
        )  # fmt: skip

    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns this rank's mean loss (a device tensor). Raises
        DataFault (on every rank, before training) if a data source failed."""
        self.spike, self.step_loss, self.spike_layers = None, None, None
        with self.profiler.step(self.step + 1):
            waited = time.perf_counter()
            batches = self.data.next_step()  # the whole step, or a DataFault on every rank
            self.data_wait_s += time.perf_counter() - waited
            self.last_batch = batches[-1]
            self.lr = self.engine.deepspeed.get_lr()[0]  # this step's rate (the schedule moves on)
            screen = None if self.spikes is None else self.judge_loss
            self.watch_gradients(self.step + 1)
            with self.timer.measuring():
                loss = self.engine.train_step(iter(batches), screen)
            if self.gradients is not None:
                self.gradients.step_done()
        self.step += 1
        self.consumed_tokens += self.meter.tokens_per_step
        return loss

    def judge_loss(self, loss: torch.Tensor) -> bool:
        """The step's loss against the running estimate, before its update (collective over
        data parallelism: every rank judges the same global mean); True: skip the update."""
        self.step_loss = self.engine.global_mean(loss)  # host-device sync, every step
        self.spike = self.spikes.check(self.step + 1, self.step_loss)
        if self.spike is not None and self.gradients is not None:  # every rank alike
            self.spike_layers = self.gradients.spike_report()  # before the update
        return self.spike is not None and self.cfg.train.spike.action == "skip"

    def watch_gradients(self, step: int) -> None:
        """Measure the per-layer gradient norms before the update of `step` if it is a
        diagnostics step (not with a pipeline, whose engine updates inside train_batch)."""
        if self.engine.pipelined:
            return
        if self.gradients is None:
            self.gradients = layer_signals.GradientWatch(self.engine.deepspeed.module)
        interval = self.cfg.run.diagnostics_interval
        due = bool(interval) and step % interval == 0
        self.engine.before_update = self.gradients.measure if due else None

    def report_spike(self, spike: Spike) -> None:
        """A metrics row (prefix `spike`) and a warning line for a loss spike."""
        if self.metrics is None:
            return
        skipped = self.engine.update_vetoed
        norms, grown = self.spike_layers or ({}, [])
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

    def log(self, loss: torch.Tensor) -> float:
        """Log this step's scalars (collective: the loss is averaged over data parallelism)
        and return the loss."""
        norm = self.engine.deepspeed.get_global_grad_norm()
        mean = self.engine.global_mean(loss) if self.step_loss is None else self.step_loss
        forward_s = self.timer.take() / (self.step - self.meter.last_step)  # per step
        scalars = self.meter.scalars(
            self.step, mean, self.lr, None if norm is None else float(norm), self.data_wait_s
        )
        for name, value in self.engine.reported.items():  # z_loss (collective)
            scalars[name] = self.engine.global_mean(value)
        scalars.update(self.data.stats())  # data health, summed over the ranks
        if dist.get_world_size() > 1:  # a straggler shows in the spread (one all-gather)
            scalars.update(rank_spread(forward_s))
        if self.metrics is not None:
            self.metrics.log(self.step, scalars)
            self.progress.update(self.step, scalars)
        return scalars["loss"]

    def validate(self) -> float:
        """Log the held-out loss (collective) and return it."""
        engine = self.engine
        loss, tokens = validation_loss(engine.deepspeed, self.validation, engine.pipelined)
        scalars = {"val_loss": loss, "val_perplexity": math.exp(loss), "val_tokens": tokens}
        if self.metrics is not None:
            self.metrics.log(self.step, scalars, prefix="val")
            log.info("step %d | %s", self.step, format_scalars(scalars))
        return loss

    def evaluate_tasks(self, checkpoint: Path) -> dict[str, float] | None:
        """Run train.eval_tasks on `checkpoint` and log their scores (collective)."""
        cfg = self.cfg
        scores = downstream.evaluate(cfg.train, checkpoint, cfg.run.device, self.run_dir)
        if self.metrics is not None:
            self.metrics.log(self.step, scores, prefix="downstream")
            log.info("step %d | %s", self.step, format_scalars(scores))
        return scores

    def diagnose(self) -> None:
        """Belief diagnostics on this step's last micro-batch (training is not perturbed)."""
        tokens, labels = self.last_batch
        engine = self.engine
        stats = belief_diagnostics(engine.deepspeed, tokens, labels, engine.pipelined)
        signals = {k: stats.pop(k) for k in list(stats) if layer_signals.is_forward_signal(k)}
        signals.update({} if self.gradients is None else self.gradients.reference)
        if self.metrics is not None:
            self.metrics.log(self.step, stats, prefix="belief", jsonl="diagnostics.jsonl")
            self.metrics.log(self.step, signals, prefix="layers")  # metrics.jsonl

    def state_dict(self) -> dict:
        """This rank's state beyond the engine's and the data's: its RNG states, and the
        loss history spikes are judged against."""
        state = trainer_state.rank_state(self.layout)
        if self.spikes is not None:
            state["spikes"] = self.spikes.state_dict()
        return state

    def save(self, wait: bool = True) -> Path:
        """Checkpoint this step (collective), with the data position of every rank. `wait`:
        return once it is published (with checkpoint.async_save, else once it is in host
        memory: `checkpoints.poll` publishes it at a later step)."""
        return trainer_state.save(
            self.cfg, self.checkpoints, self.state_dict(), self.layout, self.step,
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


def data_collective() -> Collective:
    """How the data streams of the ranks agree each step: one all-reduce over the whole
    job (each reader's counts arrive once per tensor x pipeline replica), and the
    messages of a failed source gathered only when one failed."""
    from megatron.core import parallel_state as ps

    from belief_lm.parallel.collectives import collective_device

    def sum_over_job(values: torch.Tensor) -> torch.Tensor:
        total = values.to(collective_device())
        dist.all_reduce(total)
        return total.cpu()

    def gather(value) -> list:
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values

    replicas = dist.get_world_size() // ps.get_data_parallel_world_size()
    return Collective(sum=sum_over_job, gather=gather, replicas=replicas)
