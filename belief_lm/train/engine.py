"""The model in DeepSpeed's engine (`Trainee`): ZeRO, pipeline, accumulation, clipping, bf16.

Without pipeline parallelism the plain engine wraps `BeliefLM` (ZeRO 0-3, tensor
parallelism described to DeepSpeed by the grid's mpu adapter); with it, the pipeline engine
runs 1F1B over the stages of `belief_lm.model.pipeline` (ZeRO-1 at most: DeepSpeed's
limit), laid out by the grid's topology. We hand DeepSpeed a ready optimizer and scheduler;
the engine owns the accumulation boundary, clipping, the optimizer/scheduler steps, and
checkpoints. A step returns what it did (`StepOutcome`).

The loss is weighted by tokens (Megatron's calculate_per_token_loss): a step's loss, and
its gradient, is the sum of its label tokens' cross entropies over every micro-batch and
data-parallel rank divided by the step's label count, whatever the split. The model returns
each micro-batch's mean over its own labels; `label_weights` turns those into shares of
the step's token mean (one all-reduce of the label count per step), so that DeepSpeed's
division by the accumulation steps and its average over data parallelism (plain and
pipeline engine alike) leave exactly that. A padded window at an epoch's end, or masked
labels, then weigh each token like a full batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

from belief_lm import compat
from belief_lm.config import Config
from belief_lm.model.gpt import BeliefLM
from belief_lm.model.loss import IGNORE_INDEX
from belief_lm.parallel.collectives import all_reduce_unless_alone
from belief_lm.parallel.gather import count_model_parameters, counted_once
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.train.optim import GuardedAdamW, Update, build_optimizer
from belief_lm.train.spikes import LossCheck


def deepspeed_config(cfg: Config, accumulation: int, bf16: bool) -> dict:
    """DeepSpeed's JSON config, derived from ours and from what pre-flight decided (users
    never write it by hand)."""
    return {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        # DeepSpeed defaults clipping to 1.0 when unset: always state it.
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {"stage": cfg.parallel.zero_stage},
        # ZeRO checks the optimizer's exact type; ours is torch's AdamW plus a skip guard.
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
        # The pipeline engine would send each stage boundary's tensor in 1/TP pieces, one
        # per tensor-parallel rank, gathered on arrival: right for a tensor every rank
        # holds whole, wrong for sequence parallelism's [seq / TP, batch, hidden], which
        # differs per rank (each rank sends its own part, already 1/TP of the bytes).
        "pipeline": {
            "pipe_partitioned": not cfg.parallel.sequence_parallel_on,
            "grad_partitioned": not cfg.parallel.sequence_parallel_on,
        },
    }


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step of the engine did."""

    loss: torch.Tensor
    """This rank's mean loss over its micro-batches (a device tensor: reading it syncs)."""
    update: Update | None
    """What the optimizer decided (None: it was not called: DeepSpeed's own overflow check
    skipped the step)."""
    check: LossCheck | None
    """What the step's `screen` found, if it had one."""
    reported: dict[str, torch.Tensor] = field(default_factory=dict)
    """What the model computed beside the loss (z_loss with train.z_loss): this rank's mean
    over its micro-batches (a pipeline's: already averaged over data parallelism, as its
    loss), to `Trainee.global_mean` like the loss."""

    @property
    def nonfinite(self) -> bool:
        """Whether the update was skipped for a non-finite gradient (decided on every rank
        together); a step DeepSpeed's overflow check skipped counts too."""
        return self.update is None or self.update.nonfinite

    @property
    def vetoed(self) -> bool:
        """Whether the update was skipped because the `screen` asked (on some rank)."""
        return self.update is not None and self.update.vetoed and not self.update.nonfinite


@dataclass
class Trainee:
    """The model in DeepSpeed's engine, and the one optimizer step training repeats."""

    engine: object
    """DeepSpeed's engine (or pipeline engine) around the model."""
    optimizer: GuardedAdamW
    """Ours, inside the engine: it skips non-finite and vetoed updates."""
    grid: ProcessGrid
    parameters: int
    """Whole-model parameter count (all ranks)."""
    pipelined: bool
    reduces_gradients: bool = True
    """Whether DeepSpeed's engine reduces the gradients over data parallelism after the
    last backward of a step. Not at ZeRO-0 without a data-parallel peer (`alone`): there
    DeepSpeed would still flatten every gradient into one buffer, scale it by 1, all-reduce
    it over a group of one and copy it back (DeepSpeedEngine.allreduce_gradients ->
    buffered_allreduce_fallback), three passes over the gradients that change no bit."""
    before_update: Callable[[], object] | None = None
    """Called once the step's gradients are complete, before `screen` and the update (per-
    layer gradient norms: belief_lm/train/layer_signals.py); with a pipeline, on every
    stage from inside train_batch (compat.before_pipeline_update)."""
    _inside_pipeline_step: Callable[[], object] | None = field(default=None, init=False)
    """What the pipeline engine calls before this step's update (set by train_step)."""

    def __post_init__(self) -> None:
        if self.pipelined:  # the engine updates inside train_batch: it calls this first
            compat.before_pipeline_update(self.engine, self._before_pipeline_update)

    def _before_pipeline_update(self) -> None:
        if self._inside_pipeline_step is not None:
            self._inside_pipeline_step()

    def train_step(
        self, micro_batches: Iterator, screen: Callable[[torch.Tensor], LossCheck] | None = None
    ) -> StepOutcome:
        """One optimizer step over the accumulation micro-batches; its loss is this rank's
        share of the step's token-weighted loss, whose `global_mean` is the step's loss.

        `screen`, when given, sees the step's mean loss once its gradients are complete and
        before the update, and its LossCheck says whether to skip the update (the optimizer
        makes every rank skip if any says so). With a pipeline, `before_update` and `screen`
        run inside train_batch before the engine's optimizer step, every stage seeing the
        step's loss (compat.pipeline_step_loss); there `screen` may not ask to skip."""
        engine, optimizer = self.engine, self.optimizer
        optimizer.take_update()  # (nothing left from a step that failed)
        accumulation = engine.gradient_accumulation_steps()
        batches = [next(micro_batches) for _ in range(accumulation)]
        weights = label_weights(engine, [labels for _, labels in batches])
        if self.pipelined:  # 1F1B over all micro-batches, optimizer step included
            engine.module.label_weights = list(weights)  # the loss_fn's, in the engine's order
            checks: list[LossCheck] = []

            def before_update() -> None:  # on every stage, its gradients complete
                if self.before_update is not None:
                    self.before_update()
                if screen is not None:
                    checks.append(screen(compat.pipeline_step_loss(engine)))
                if checks and checks[0].skip:  # preflight refuses it: raised before the update
                    raise RuntimeError("a pipelined step was asked to skip its update")

            self._inside_pipeline_step = before_update
            try:
                loss = engine.train_batch(data_iter=iter(batches))
            finally:
                self._inside_pipeline_step = None
            reported = dict(engine.get_additional_losses() or {})
            check = checks[0] if checks else None
            return StepOutcome(loss, optimizer.take_update(), check, reported)
        total, check, reported = None, None, {}
        for micro, ((tokens, labels), weight) in enumerate(zip(batches, weights, strict=True)):
            loss = engine(tokens, labels) * weight
            with record_function("backward"), self._reduction():
                engine.backward(loss)  # DeepSpeed divides by the accumulation steps
            total = loss.detach() if total is None else total + loss.detach()
            for name, value in (engine.module.get_additional_losses() or {}).items():
                reported[name] = reported.get(name, 0) + value * weight / accumulation
            if self.before_update is not None and micro == accumulation - 1:
                self.before_update()
            if screen is not None and micro == accumulation - 1:
                check = screen(total / accumulation)  # before the update
            with optimizer.vetoing(check is not None and check.skip):
                engine.step()  # optimizer + scheduler step only at the accumulation boundary
        return StepOutcome(total / accumulation, optimizer.take_update(), check, reported)

    def _reduction(self) -> contextlib.AbstractContextManager:
        """Where a backward runs: with DeepSpeed's gradient reduction, or without it
        (engine.no_sync, DeepSpeed's own switch: ZeRO-0 only) where there is nothing to
        reduce (`reduces_gradients`)."""
        return contextlib.nullcontext() if self.reduces_gradients else self.engine.no_sync()

    def global_mean(self, loss: torch.Tensor) -> float:
        """This step's loss averaged over the global batch, on every rank (collective over
        data parallelism; the pipeline engine already averages)."""
        if self.pipelined:
            return loss.item()  # host-device sync
        return self.grid.data_parallel_mean(loss)


def label_weights(engine, labels: list[torch.Tensor]) -> torch.Tensor:
    """Per micro-batch of this rank's step, the factor that turns its mean loss (over its
    own labels) into its share of the step's token mean: its label count x accumulation
    steps x data-parallel ranks / the step's label count over all of them (all-reduced over
    data parallelism; DeepSpeed divides by the first two factors again). A step with no
    label at all weighs 0."""
    device = engine.device
    counts = torch.stack([(part != IGNORE_INDEX).sum() for part in labels]).to(device)
    total = counts.sum()
    ranks = engine.dp_world_size
    if ranks > 1:
        dist.all_reduce(total, group=engine.data_parallel_group)  # where gradients average
    return counts * (len(labels) * ranks) / total.clamp_min(1)


def build_trainee(
    cfg: Config,
    grid: ProcessGrid,
    vocab_size: int,
    device: torch.device,
    *,
    bf16: bool,
    accumulation: int,
    load_universal: bool = False,
    weights: dict[str, torch.Tensor] | None = None,
    eos_id: int | None = None,
) -> Trainee:
    """Build this rank's model (or pipeline stage) and wrap it in DeepSpeed's engine.
    `bf16` and `accumulation` are pre-flight's (preflight.Preflight); `load_universal`: the
    checkpoint to resume from is in DeepSpeed's universal format; `weights`: whole tensors
    (BeliefLM's names) to start from instead of the seeded init; `eos_id`: the tokenizer's
    EOS, where documents end under model.attention_mask=document."""
    import deepspeed  # imported after select_device set the accelerator

    from belief_lm.model.pipeline import build_pipeline, canonical_name

    layout = grid.layout
    pipelined = layout.pipeline > 1
    # how training computes, never the result
    execution = {
        "loss_chunk_tokens": cfg.train.loss_chunk_tokens,
        "recompute": cfg.train.activation_checkpointing,
        "sequence_parallel": cfg.parallel.sequence_parallel_on,
        "eos_id": eos_id,
    }
    z_loss = cfg.train.z_loss  # part of the objective
    if pipelined:
        model = build_pipeline(
            cfg.model, vocab_size, grid.topology, layout.tensor, cfg.run.seed, **execution,
            z_loss=z_loss,
        )  # fmt: skip
    else:
        model = BeliefLM(
            cfg.model, vocab_size, layout.tensor, seed=cfg.run.seed, **execution, z_loss=z_loss
        )
    if weights is not None:  # before DeepSpeed takes the weights (ZeRO partitions, bf16)
        from belief_lm.checkpoint.consolidate import load_full_state

        rename = (lambda name: canonical_name(name, cfg.model.num_layers)) if pipelined else None
        load_full_state(model, weights, rename)
    model.to(device)
    parameters = count_model_parameters(model)  # before ZeRO-3 partitions them away
    for module in model.modules():
        module.register_state_dict_post_hook(compat.drop_empty_extra_state)

    ds_config = deepspeed_config(cfg, accumulation, bf16)
    ds_config["checkpoint"] = {"load_universal": load_universal}
    # a pipeline module carries DeepSpeed's grid, made from the topology
    groups = model.mpu() if pipelined else grid.mpu
    clip = None
    if cfg.parallel.zero_stage == 0 and not bf16:
        # Here DeepSpeed would clip but drop the norm; our optimizer clips instead.
        ds_config["gradient_clipping"] = 0.0
        clip = ClipByGlobalNorm(cfg.train.grad_clip, groups)
    optimizer, scheduler = build_optimizer(model, cfg.train, device, clip)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
        mpu=None if pipelined else groups,
    )  # fmt: skip
    compat.one_pass_grad_norm(engine.optimizer)  # ZeRO-1/2's clipping norm
    if bf16:
        # DeepSpeed's bf16 optimizers skip a step with a non-finite gradient as a whole
        # (ZeRO steps each parameter group apart, so our optimizer's own guard could not),
        # but check each tensor with a dozen kernels: one pass instead
        compat.one_pass_overflow_check(engine.optimizer)
    if pipelined and cfg.model.attention_mask == "document":
        engine.set_has_attention_mask(True)  # stages hand on (hidden, document ends: bool)
    alone = engine.dp_world_size == 1 and cfg.parallel.zero_stage == 0 and not pipelined
    return Trainee(engine, optimizer, grid, parameters, pipelined, reduces_gradients=not alone)


@dataclass(frozen=True)
class ClipByGlobalNorm:
    """Clipping by the whole model's gradient norm, for GuardedAdamW to apply before its
    update (`clip`) where DeepSpeed's own clipping would drop the norm (ZeRO-0 in fp32).
    The coefficient is DeepSpeed's, max_norm / (norm + 1e-6)."""

    max_norm: float
    mpu: object
    """Where the model-parallel peers are (DeepSpeed's mpu interface)."""

    def clip(self, params: list[torch.nn.Parameter], norms: list[torch.Tensor]) -> float:
        """Scale the gradients of `params` (whose 2-norms are `norms`, one per parameter)
        so that the whole model's norm is at most max_norm; returns that norm before
        clipping (collective over the model-parallel group: a host-device sync)."""
        norm = global_grad_norm(params, norms, self.mpu)
        coefficient = self.max_norm / (norm + 1e-6)
        if self.max_norm > 0 and coefficient < 1:
            compat.scale_in_place([p.grad for p in params], coefficient)
        return norm


def global_grad_norm(params: list[torch.nn.Parameter], norms: list[torch.Tensor], mpu) -> float:
    """2-norm of the whole model's gradient from this rank's `params` and their gradients'
    `norms`: TP-replicated weights counted on TP rank 0 only, the output stage's copy of a
    tied embedding not at all, squares summed over the model-parallel (TP x PP) group.
    DeepSpeed's own helpers each miss one of these rules."""
    tp_rank = mpu.get_tensor_model_parallel_rank()
    counted = [n for p, n in zip(params, norms, strict=True) if counted_once(p, tp_rank)]
    device = norms[0].device if norms else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=device)
    if counted:  # torch.nn.utils.get_total_norm's sum of the same norms
        squares = torch.linalg.vector_norm(torch.stack(counted)).float().square()
    all_reduce_unless_alone(squares, group=mpu.get_model_parallel_group())
    return float(squares.sqrt())
