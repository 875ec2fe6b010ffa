"""Typed, validated run configuration: model / data / parallel / train / run.

A run is described by YAML files composed with `include:` (paths relative to the including
file, merged in order, the including file last) and dotted command-line overrides
(`model.attention=belief_star train.max_steps=50`). Every section forbids unknown keys and
checks its values, so a typo or a bad value fails before any work starts with a message
naming the key. Field docstrings are the reference documentation of each option.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from belief_lm.errors import BadInput
from belief_lm.variants import VARIANTS, AttentionVariant, Variant
from data_pipeline.config import DataConfig, PositiveInt, Section


class ConfigError(BadInput):
    """A configuration problem, with the offending key in the message."""


class ModelConfig(Section):
    """Decoder architecture (megatron-core layers) and the attention variant."""

    name: str = "custom"
    """Preset name, recorded in logs."""
    num_layers: PositiveInt = 4
    """Decoder layers."""
    hidden_size: PositiveInt = 128
    """Model width (d_model)."""
    num_attention_heads: PositiveInt = 4
    """Query heads."""
    num_query_groups: PositiveInt | None = None
    """Key/value heads for grouped-query attention; None: one per query head."""
    ffn_hidden_size: PositiveInt | None = None
    """MLP width; None: 4 x hidden_size."""
    seq_length: PositiveInt = 128
    """Context length: tokens per training window."""
    vocab_size: PositiveInt | None = None
    """Embedding rows; None: the tokenizer's vocabulary padded to a multiple of
    make_vocab_size_divisible_by."""
    make_vocab_size_divisible_by: PositiveInt = 128
    """Padding multiple for the vocabulary (efficient GEMMs; must be divisible by the
    tensor-parallel size)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Pre-norm type."""
    norm_epsilon: float = Field(1e-5, gt=0)
    """Epsilon of the norms."""
    qk_norm: bool = False
    """RMSNorm of each head's queries and keys before RoPE (and before any variant's own
    use of them, Attention-BN's recentring included), one weight of head_dim shared by the
    heads, for queries and for keys (Qwen3's q_norm / k_norm; megatron's qk_layernorm,
    but RMSNorm whatever `normalization` is). Keeps attention logits bounded."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP activation; swiglu is a gated linear unit with SiLU."""
    position_embedding: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Learned absolute positions (GPT-2) or rotary embeddings (Llama)."""
    rotary_base: float = Field(10000.0, gt=0)
    """RoPE theta."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    bias: bool = True
    """Biases in the linear layers."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Hidden dropout (attention dropout is not supported)."""
    init_std: float = Field(0.02, gt=0)
    """Std of the normal weight init (output projections are scaled by 1/sqrt(2 layers))."""
    attention: AttentionVariant = "softmax"
    """Attention variant: softmax, belief, belief_star, attentionx, attention_bn,
    attention_sh or attention_bn_sh."""
    gamma: float = Field(0.5, gt=0, le=1)
    """AttentionX's γ in Φ = γV - H, in (0, 1]."""
    beta: float = Field(1.0, ge=0)
    """Attention-BN's β weighting the key mean that recentres queries and keys."""
    fused_output_projection: bool = False
    """belief_star: compute Δ W^o + Δ^s W^s as one GEMM of [Δ, Δ^s] against [W^o | W^s]
    (concatenated at each call) instead of two GEMMs and an add; the same sum up to
    rounding, the same separately named weights (a checkpoint resumes with either setting).
    The other variants have one output GEMM already."""
    compile: Literal["none", "projections", "layer"] = "none"
    """torch.compile, the same math: projections compiles the variant's residual signal
    (belief's projections onto V: fused kernels); layer each whole decoder layer's training
    forward and backward (Inductor: norms, projections, attention and MLP as one graph),
    with a compilation at the start, evaluation and decoding eager. Not part of the
    architecture: a checkpoint resumes with any setting."""
    sh_scales: list[PositiveInt] = Field(default_factory=lambda: [1, 1, 2, 4])
    """Attention-SH per-head downsampling factors, repeated across the heads (its length
    must divide num_attention_heads)."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        heads, groups = self.num_attention_heads, self.query_groups
        if self.hidden_size % heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({heads})"
            )
        if heads % groups:
            raise ValueError(
                f"num_attention_heads ({heads}) must be divisible by num_query_groups ({groups})"
            )
        if heads % len(self.sh_scales):
            raise ValueError(
                f"sh_scales has {len(self.sh_scales)} entries, which does not divide "
                f"num_attention_heads ({heads})"
            )
        return self

    @property
    def variant(self) -> Variant:
        """What the attention variant computes (variants.VARIANTS[attention])."""
        return VARIANTS[self.attention]

    @property
    def query_groups(self) -> int:
        """Key/value heads, resolved: num_query_groups, or one per query head."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """MLP width, resolved: ffn_hidden_size, or 4 x hidden_size."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def head_scales(self) -> list[int]:
        """Attention-SH scale of every head (sh_scales repeated)."""
        return self.sh_scales * (self.num_attention_heads // len(self.sh_scales))


def padded_vocab_size(tokenizer_vocab: int, model: ModelConfig, tensor_parallel: int) -> int:
    """model.vocab_size if set (checked to hold the tokenizer), else the tokenizer's size
    rounded up to a multiple of make_vocab_size_divisible_by. Not to a multiple of
    divisible_by x TP, as megatron does: the size would then depend on the layout and a
    checkpoint could not move to another TP size."""
    if model.vocab_size is not None:
        if model.vocab_size < tokenizer_vocab:
            raise ConfigError(
                f"model.vocab_size ({model.vocab_size}) is smaller than the tokenizer's "
                f"vocabulary ({tokenizer_vocab})"
            )
        size = model.vocab_size
    else:
        multiple = model.make_vocab_size_divisible_by
        size = -(-tokenizer_vocab // multiple) * multiple
    if size % tensor_parallel:
        raise ConfigError(
            f"the vocabulary ({size}) is not divisible by the tensor-parallel size "
            f"({tensor_parallel}); set model.vocab_size or model.make_vocab_size_divisible_by"
        )
    return size


class ParallelConfig(Section):
    """How the world is split: tensor x pipeline x data (the rest) parallel."""

    tensor: PositiveInt = 1
    """Tensor-parallel size (heads and MLP columns split across ranks)."""
    pipeline: PositiveInt = 1
    """Pipeline-parallel stages."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage for the data-parallel optimizer state (at most 1 with a
    pipeline)."""
    timeout_s: PositiveInt = 600
    """Seconds a rank waits in a collective before failing: every process group of the run
    (ours, megatron-core's, DeepSpeed's) has it, so a silent rank ends the job with exit
    code 69 within about this long, one line naming the collective and the silent ranks.
    Longer than any step, save or evaluation takes; shorter than the time you would lose."""
    rank_zero_wait_s: PositiveInt = 7200
    """Seconds the other ranks wait for rank 0's one-off work before failing (training the
    tokenizer, converting a checkpoint, downstream evaluation): longer than that work takes.
    A rank 0 that stops answering meanwhile is found within timeout_s (its heartbeat)."""


class SpikeConfig(Section):
    """Loss spikes: a step's loss judged against a running robust estimate of the loss (the
    median and the median absolute deviation of the last `window` steps' losses)."""

    threshold: float | None = Field(6.0, gt=0)
    """A step whose loss is more than this many deviations (1.4826 x MAD, the standard
    deviation for normal noise) above the median is a spike; None: no spike detection
    (it costs one small all-reduce and a host sync per step)."""
    window: int = Field(100, ge=3)
    """Steps of loss history the median and MAD are taken over."""
    min_history: int = Field(20, ge=3)
    """Steps of history needed before any step is judged (the first steps after a start
    or a resume without saved history are not)."""
    action: Literal["log", "skip", "stop"] = "log"
    """log: a metrics row and a warning; skip: also leave that step's update unapplied (on
    every rank; not with parallel.pipeline > 1); stop: log, and after max_in_row spikes
    in a row save and exit (exit code 3)."""
    max_in_row: PositiveInt = 3
    """Consecutive spikes after which action=stop saves and stops the run."""

    @model_validator(mode="after")
    def _consistent(self) -> SpikeConfig:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history ({self.min_history}) must not exceed window ({self.window})"
            )
        return self


class TrainConfig(Section):
    """Optimisation: AdamW, the learning-rate schedule, clipping, accumulation, the loss."""

    max_steps: PositiveInt = 100
    """Optimizer steps to run."""
    micro_batch_size: PositiveInt = 8
    """Sequences per forward/backward on one data-parallel rank."""
    global_batch_size: PositiveInt = 8
    """Sequences per optimizer step over all ranks (reached by gradient accumulation)."""
    global_batch_tokens: PositiveInt | None = None
    """Tokens per optimizer step instead of global_batch_size (a multiple of
    model.seq_length); sets global_batch_size."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(1e-4, ge=0)
    """Learning rate at the end of the decay (cosine and wsd)."""
    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """After the warmup: cosine, from lr down to min_lr at decay_steps; wsd
    (warmup-stable-decay), lr held, then decayed to min_lr at decay_steps over the last
    wsd_decay_steps (or wsd_decay_fraction) of them, in the shape wsd_decay_shape; constant,
    lr held to the end. Then min_lr (cosine, wsd) until max_steps."""
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup steps."""
    decay_steps: PositiveInt | None = None
    """Step at which the decay reaches min_lr (cosine, wsd); None: max_steps."""
    wsd_decay_steps: PositiveInt | None = None
    """wsd: steps of the decay, ending at decay_steps (Megatron's lr_wsd_decay_iters);
    None: wsd_decay_fraction of decay_steps."""
    wsd_decay_fraction: float | None = Field(None, gt=0, le=1)
    """wsd: the decay's share of the steps up to decay_steps (OLMo-core's decay_fraction),
    instead of wsd_decay_steps; None with neither set: 0.2."""
    wsd_decay_shape: Literal["linear", "cosine", "1-sqrt"] = "linear"
    """wsd: how the decay goes from lr to min_lr, with r its share done: linear (1 - r),
    cosine ((1 + cos(pi r)) / 2) or 1-sqrt (1 - sqrt(r))."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay, applied to weights of two or more dimensions only."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW β1."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """AdamW β2."""
    eps: float = Field(1e-8, gt=0)
    """AdamW ε."""
    grad_clip: float = Field(1.0, ge=0)
    """Global gradient-norm clip; 0 disables it."""
    adamw_kernel: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """torch AdamW's implementation (the same update): fused (one kernel for all
    parameters), foreach (batched ops) or for_loop (one parameter at a time); auto: fused on
    GPU, for_loop on CPU."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision; auto: bf16 on GPU, fp32 on CPU."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute activations in backward instead of storing them: none; selective (each
    layer's attention core, FamilyCoreAttention: softmax and the belief projections, as
    Megatron's recompute_granularity=selective); full (each whole decoder layer). true and
    false, from older configs, mean full and none."""
    z_loss: float = Field(0.0, ge=0)
    """Coefficient of the z-loss added to the training objective: z_loss x the mean, over
    the trained tokens, of log(sum of exp(logits))^2 over the whole vocabulary (PaLM,
    OLMo); it keeps the output logits from drifting. Logged as `z_loss` beside the loss
    (which stays the cross entropy). 0: none. E.g. 1e-4."""
    loss_chunk_tokens: int = Field(0, ge=0)
    """0: the loss from the whole micro-batch's logits, whose fp32 softmax (4 bytes per
    token and vocabulary row) is kept for backward; N: the output GEMM and the cross
    entropy N tokens at a time, recomputed in backward, so nothing vocabulary-sized is
    kept (the same loss and gradients; the output GEMM runs once more). E.g. 4096."""
    eval_interval: int = Field(0, ge=0)
    """Steps between validation-loss evaluations (and at the last step); 0: never."""
    eval_batches: PositiveInt = 20
    """Held-out micro-batches per data-parallel rank in each evaluation."""
    eval_tasks: list[str] = Field(default_factory=list)
    """lm-evaluation-harness tasks to run on the model during training: task names, or
    paths of local task YAML files (needs lm-eval: `pip install 'belief-lm[eval]'`)."""
    eval_tasks_interval: int = Field(0, ge=0)
    """Steps between runs of eval_tasks, each on the checkpoint saved at that step (a
    multiple of checkpoint.interval; also at the last step); 0: at the last step only."""
    max_nonfinite_steps: PositiveInt = 5
    """Consecutive steps with a non-finite gradient (skipped on every rank) after which
    the run stops with an error."""
    spike: SpikeConfig = Field(default_factory=SpikeConfig)
    """Loss-spike detection and what to do about a spike."""

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _recompute_from_bool(cls, value: Any) -> Any:
        # this field was a bool (true: recompute whole layers); saved configs still say so
        if isinstance(value, bool):
            return "full" if value else "none"
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        # with global_batch_tokens the batch is derived, and checked, by Config
        if self.global_batch_tokens is None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainConfig:
        wsd = {"wsd_decay_steps": self.wsd_decay_steps,
               "wsd_decay_fraction": self.wsd_decay_fraction}  # fmt: skip
        given = [name for name, value in wsd.items() if value is not None]
        if self.lr_schedule != "wsd" and given:
            raise ValueError(f"{given[0]} applies to lr_schedule=wsd, not {self.lr_schedule}")
        if len(given) > 1:
            raise ValueError("wsd_decay_steps and wsd_decay_fraction both set; set one of them")
        if self.lr_schedule == "wsd" and self.decay_start < self.warmup_steps:
            what = given[0] if given else "wsd_decay_fraction (default 0.2)"
            raise ValueError(
                f"{what}: the decay ({self.decay_end - self.decay_start} steps, ending at step "
                f"{self.decay_end}) would start before the warmup ends (warmup_steps="
                f"{self.warmup_steps})"
            )
        return self

    @property
    def decay_end(self) -> int:
        """The step at which the learning rate reaches min_lr (cosine, wsd), after warmup."""
        return max(self.decay_steps or self.max_steps, self.warmup_steps + 1)

    @property
    def decay_start(self) -> int:
        """The step at which the decay begins: the warmup's end (cosine), the stable phase's
        end (wsd); decay_end for a constant rate (which never decays)."""
        if self.lr_schedule == "cosine":
            return self.warmup_steps
        if self.lr_schedule == "constant":
            return self.decay_end
        length = self.wsd_decay_steps
        if length is None:
            length = max(1, round((self.wsd_decay_fraction or 0.2) * self.decay_end))
        return self.decay_end - length


class CheckpointConfig(Section):
    """When to save, how many to keep, what to resume from."""

    interval: int = Field(0, ge=0)
    """Steps between checkpoints; 0: only at the end and on a stop signal."""
    keep: PositiveInt = 2
    """Intact checkpoints kept in run.output_dir/checkpoints; older ones (intact or damaged)
    are deleted after each save."""
    save_at_end: bool = True
    """Save when train.max_steps is reached."""
    resume: str = "auto"
    """'auto': the newest intact checkpoint of run.output_dir, if any (damaged ones are
    skipped with a warning); 'never'; or the path of a checkpoint directory."""
    async_save: bool = False
    """Write checkpoints in the background: a save copies the state to host memory (the
    only pause) and training continues while a thread per rank writes it; it is published
    (manifest, run.json, `latest`) at a later step once every rank has written its files.
    A stop signal and the end of training wait for it. Costs host memory for one more copy
    of each rank's checkpoint state."""
    trust: bool = Field(False, exclude=True)
    """Resume from a checkpoint whose files hold more than a checkpoint may (one an earlier
    belief-lm wrote): those files are loaded with pickle, which can run any code they hold,
    after a warning naming each. Only for checkpoints you made yourself; off, such a
    checkpoint is refused (exit 2) naming the file (docs/checkpoints.md). Never saved with
    the run's config (`--trust-checkpoint` or checkpoint.trust=true on each command)."""


class WandbConfig(Section):
    """Weights & Biases (optional: `pip install 'belief-lm[wandb]'`): the run's scalars,
    effective config and environment, from rank 0."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    """disabled: no W&B; offline: files under run.output_dir/wandb to `wandb sync` later;
    online: streamed to the W&B server (needs `wandb login` or WANDB_API_KEY)."""
    project: str = "belief-lm"
    """W&B project."""
    entity: str | None = None
    """W&B team or user; None: the logged-in user's default."""
    name: str | None = None
    """Display name of the W&B run; None: the name of run.output_dir."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""


class ProfileConfig(Section):
    """A torch.profiler trace of a few training steps (and on GPU a CUDA memory snapshot)."""

    start_step: PositiveInt | None = None
    """First step to record; None: no profiling."""
    steps: PositiveInt = 3
    """Steps recorded from start_step on."""


class RunConfig(Section):
    """Where outputs go and how the run is logged."""

    output_dir: str = "runs/default"
    """Run directory: config, metrics, tensorboard events, checkpoints."""
    seed: int = 1234
    """Seed of the weight init (per pipeline stage) and everything else random."""
    log_interval: PositiveInt = 1
    """Steps between metric logs."""
    tensorboard: bool = True
    """Write tensorboard events under output_dir/tensorboard."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to compute; auto: cuda if available."""
    cache_dir: str = "~/.cache/belief-lm"
    """Cache of trained tokenizers and prepared data."""
    diagnostics_interval: int = Field(0, ge=0)
    """Steps between belief diagnostics per layer (BeliefFormer Fig. 4); 0: never."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak dense TFLOP/s of one device, for MFU; None: looked up for known GPUs (bf16)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging (disabled by default)."""
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    """Profiling of a few steps, written under output_dir/profile."""


def _one_word(value: str) -> str:
    if not value or any(c.isspace() or c in "'\"" for c in value):
        raise ValueError(f"{value!r} must be one word without quotes (it becomes an sbatch option)")
    return value


def _variable_name(value: str) -> str:
    if not value.isidentifier() or not value.isascii():
        raise ValueError(f"{value!r} is not an environment variable name")
    return value


SlurmWord = Annotated[str, AfterValidator(_one_word)]


class LaunchConfig(Section):
    """How `belief-lm launch` starts the run: tasks per node, and for SLURM the allocation,
    the time-limit warning and requeueing, and an optional pyxis/enroot container."""

    nodes: PositiveInt = 1
    """Nodes (SLURM); `launch local` runs on one."""
    min_nodes: PositiveInt | None = None
    """Accept an allocation of as few as this many nodes (SLURM --nodes=MIN-MAX; how many
    of the range a job gets is the scheduler's choice, and select/cons_tres may start it
    on MIN): a job requeued while nodes are down runs on those it gets and continues the
    run at the smaller data-parallel size. None: exactly `nodes` (a requeued job still
    continues on whatever allocation it is given, e.g. after `scontrol update NumNodes`)."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node, one task each; 0: CPU tasks (gloo)."""
    tasks_per_node: PositiveInt | None = None
    """Processes per node; None: gpus_per_node, or 1 without GPUs."""
    cpus_per_task: PositiveInt | None = None
    """CPU cores per task (also OMP_NUM_THREADS); None: the partition's default."""
    partition: SlurmWord | None = None
    """SLURM partition; required with GPUs."""
    account: SlurmWord | None = None
    """SLURM account to charge; None: the user's default."""
    time_minutes: PositiveInt = 60
    """Wall-clock limit of each job in minutes (a requeued job gets a new one)."""
    job_name: SlurmWord | None = None
    """SLURM job name; None: belief-lm-<model.name>."""
    signal_seconds: int = Field(300, ge=0, le=65535)
    """SIGUSR1 this many seconds before the time limit, so the run checkpoints and requeues
    itself; 0: no warning."""
    max_restarts: int = Field(20, ge=0)
    """Requeues after which a job that asks for another stops instead."""
    failure_restarts: int = Field(0, ge=0)
    """Restarts in place after a failure: when a rank dies or the job fails with any code
    but 0, 2, 3 or 75, `launch local` and the sbatch template start the ranks again in the
    same allocation, resuming from the newest checkpoint, up to this many times (each one
    recorded in starts.jsonl). 0: a failure ends the job."""
    log_dir: str | None = None
    """Where SLURM writes job logs and the rendered script; None: <run.output_dir>/slurm."""
    container_image: SlurmWord | None = None
    """pyxis/enroot image for the tasks (srun --container-image); None: run on the host."""
    container_mounts: list[SlurmWord] = Field(default_factory=list)
    """More pyxis mounts SRC:DST (the submit directory is always mounted at its own path)."""
    sbatch_options: list[SlurmWord] = Field(default_factory=list)
    """More #SBATCH options, verbatim, e.g. --qos=high or --exclusive."""
    env: dict[Annotated[str, AfterValidator(_variable_name)], str] = Field(default_factory=dict)
    """Environment variables for the tasks, e.g. {NCCL_SOCKET_IFNAME: ib0}."""

    @model_validator(mode="after")
    def _consistent(self) -> LaunchConfig:
        if self.gpus_per_node and self.tasks_per_node not in (None, self.gpus_per_node):
            raise ValueError(
                f"tasks_per_node ({self.tasks_per_node}) must equal gpus_per_node "
                f"({self.gpus_per_node}): one task per GPU"
            )
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must not exceed nodes ({self.nodes})")
        if self.signal_seconds >= 60 * self.time_minutes:
            raise ValueError(
                f"signal_seconds ({self.signal_seconds}) must be shorter than time_minutes "
                f"({self.time_minutes} min)"
            )
        return self

    @property
    def tasks(self) -> int:
        """Processes per node, resolved."""
        return self.tasks_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        """Processes of the whole job: nodes x tasks per node."""
        return self.nodes * self.tasks

    @property
    def world_sizes(self) -> list[int]:
        """Every world size the job may run at (min_nodes .. nodes, x tasks per node)."""
        return [n * self.tasks for n in range(self.min_nodes or self.nodes, self.nodes + 1)]


class Config(Section):
    """A whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @model_validator(mode="after")
    def _batch_in_tokens(self) -> Config:
        tokens = self.train.global_batch_tokens
        if tokens is None:
            return self
        if tokens % self.model.seq_length:
            raise ValueError(
                f"train.global_batch_tokens ({tokens}) must be a multiple of "
                f"model.seq_length ({self.model.seq_length})"
            )
        sequences = tokens // self.model.seq_length
        if "global_batch_size" in self.train.model_fields_set and (
            self.train.global_batch_size != sequences
        ):
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) and "
                f"train.global_batch_tokens ({tokens}) disagree; set one of them"
            )
        if sequences % self.train.micro_batch_size:
            raise ValueError(
                f"train.global_batch_tokens ({tokens}) is {sequences} sequences, not a multiple "
                f"of train.micro_batch_size ({self.train.micro_batch_size})"
            )
        self.train.global_batch_size = sequences
        return self

    @model_validator(mode="after")
    def _eval_tasks_on_checkpoints(self) -> Config:
        """train.eval_tasks evaluate the checkpoint saved at their step: it must be saved."""
        every, saved = self.train.eval_tasks_interval, self.checkpoint.interval
        if self.train.eval_tasks and every and (not saved or every % saved):
            raise ValueError(
                f"train.eval_tasks_interval ({every}) must be a multiple of "
                f"checkpoint.interval ({saved}): the tasks run on the checkpoint of their step"
            )
        if self.train.eval_tasks and not every and not self.checkpoint.save_at_end:
            raise ValueError(
                "train.eval_tasks run at the last step (train.eval_tasks_interval=0) on the "
                "checkpoint saved there, but checkpoint.save_at_end is false"
            )
        return self

    def to_yaml(self) -> str:
        """The effective config as YAML (every field, defaults included)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Read `path` (with its includes), apply dotted `overrides`, validate.

    Raises ConfigError naming the file, key and value at fault.
    """
    raw = _read_with_includes(Path(path), ()) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err, Config)) from None


def _read_with_includes(path: Path, chain: tuple[Path, ...]) -> dict:
    path = path.expanduser().resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise ConfigError(f"config include cycle: {cycle}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        where = f" (included from {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{where}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        _deep_merge(merged, _read_with_includes(path.parent / inc, (*chain, path)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(base: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def _describe(err: ValidationError, root: type[BaseModel]) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key{_suggest(e['loc'], root)}")
        elif e["type"] == "value_error":
            message = e["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {message}" if loc else message)
        else:
            lines.append(f"{loc} = {e.get('input')!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _suggest(loc: tuple, root: type[BaseModel]) -> str:
    """' (did you mean ...?)' for a misspelt key, looked up in the schema at its parent."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):  # a list index: stay on the list's item model
            continue
        field = model.model_fields.get(part)
        if field is None:
            return ""
        annotation = field.annotation
        args = getattr(annotation, "__args__", ()) or (annotation,)
        model = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return ""
    names = list(getattr(model, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
