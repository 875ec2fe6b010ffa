"""The planner behind `belief-lm plan`: memory per GPU and step time of a run at every
layout of N GPUs, without torch (it answers on a login node in a second).

A layout is the rank grid, tensor x pipeline x data; a candidate is a layout pre-flight
accepts (preflight.check_layout) with a ZeRO stage, a micro-batch and an activation
recompute mode. For each candidate it predicts the bytes one GPU's torch allocator holds
at its peak (what torch.cuda.max_memory_allocated reports):

- weights, gradients and optimizer state as DeepSpeed 0.19 keeps them for that ZeRO stage
  and precision (bf16 weights, fp32 masters and Adam moments partitioned over data
  parallelism from ZeRO-1; fp32 throughout on a CPU), its reduce bucket (ZeRO 1-3:
  `reduce_bucket_size` elements, 5e8 unless configured), the optimizer step's temporaries;
- activations per decoder layer, what autograd keeps for backward in this code as the
  model's description lists it (belief_lm.description.layer_saved: belief_star's Δ, Δ^s,
  the [Δ, Δ^s] input of W^o/W^s and, in bf16, the fp32 copies its inner products take;
  RoPE's cos and sin, per position, shared by the micro-batch's rows),
  under none / selective / full recompute (with sequence parallelism the layer's
  input, norms and residuals 1/TP of the sequence's: Korthikanti et al.'s s·b·h·34/t per
  layer instead of 10 + 24/t, in their units), times the
  micro-batches a pipeline stage holds (1F1B), plus the loss's fp32 softmax over the
  vocabulary on the last stage (with train.loss_chunk_tokens only one chunk's logits, in
  backward);

and the step time: FLOPs (belief_lm.train.flops, recompute included) at a stated fraction
of the GPU's peak, the pipeline bubble, and the tensor-, data- and pipeline-parallel
traffic at a stated bandwidth, not overlapped with compute (an upper bound). Parameters
per stage and rank are the description's (belief_lm.description), as are the weights
FLOPs count. The memory model is checked against allocations measured on CPU by
bench/memory.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from belief_lm.config import Config, ModelConfig, padded_vocab_size
from belief_lm.description import describe, layer_saved, norm_saved, stage_layers
from belief_lm.preflight import check_layout
from belief_lm.train.flops import (
    flops_per_token,
    loss_recompute_flops_per_token,
    recompute_flops_per_token,
)
from data_pipeline.tokenizer import Tokenizer

RECOMPUTE_MODES = ("none", "selective", "full")

REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's zero_optimization.reduce_bucket_size default (0.19): ZeRO 1-2 allocate a
bucket of it for gradients in each backward, ZeRO-3 once at start-up (a test holds it to
DeepSpeed's own default)."""

ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
"""The gradient elements DeepSpeed's ZeRO-0 engine flattens at once to all-reduce them
(buffered_allreduce_fallback's default; held to it by a test)."""

GB = 1e9


@dataclass(frozen=True)
class Machine:
    """The GPUs a plan is for, and the rates its step times assume."""

    gpus: int
    memory_gb: float
    """Memory of one GPU."""
    gpus_per_node: int = 8
    peak_tflops: float = 989.0
    """Peak dense TFLOP/s of one GPU in the run's precision (H100 SXM bf16)."""
    mfu: float = 0.4
    """Fraction of the peak the GPU reaches on the FLOPs it runs (recompute's included)."""
    bandwidth_gbs: float = 300.0
    """Collective bus bandwidth within a node, GB/s (NVLink)."""
    inter_node_bandwidth_gbs: float = 40.0
    """Bus bandwidth per GPU between nodes, GB/s (e.g. 400 Gb/s InfiniBand)."""
    reserve_gb: float = 2.0
    """Memory a GPU needs beyond the allocator's peak: CUDA context, NCCL buffers,
    fragmentation of the caching allocator."""


@dataclass(frozen=True)
class Candidate:
    """What the planner weighs: a layout (how the GPUs split), how much each GPU keeps
    (ZeRO stage, micro-batch) and what it recomputes."""

    tensor: int
    pipeline: int
    data: int
    zero_stage: int
    micro_batch: int
    recompute: str
    accumulation: int
    """Micro-batches per optimizer step on each data-parallel rank."""
    sequence_parallel: bool = False
    """Sequence parallelism (parallel.sequence_parallel) at this tensor size."""


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded GPU (its pipeline stage)."""

    stage: int
    parameters: int
    """Parameters this GPU holds (its tensor shard of its stage)."""
    weights: float
    gradients: float
    optimizer: float
    """fp32 masters and Adam moments (this GPU's partition of them)."""
    buffers: float
    """DeepSpeed's reduce bucket and flat all-reduce copies, the optimizer step's
    temporaries (the largest of them alive at the peak)."""
    resident: float
    """Held through forward and backward: weights, optimizer state (and ZeRO-3's gradient
    partition and bucket)."""
    activations: float
    """Kept for backward at the end of the forward: every in-flight micro-batch's layers,
    the loss."""
    recomputed: float
    """Rebuilt in backward by recompute, one layer's (or attention core's) at a time."""
    peak: float
    """The allocator's peak: the largest of the phases (backward start, end of backward,
    optimizer step, start-up)."""


@dataclass(frozen=True)
class Estimate:
    """A candidate's predicted memory and speed."""

    candidate: Candidate
    memory: Memory
    fits: bool
    step_time_s: float
    compute_s: float
    communication_s: float
    tokens_per_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def plan(
    cfg: Config,
    machine: Machine,
    vocab_size: int,
    max_micro_batch: int = 64,
    recompute: tuple[str, ...] = RECOMPUTE_MODES,
    both_sequence_parallel: bool = False,
) -> list[Estimate]:
    """Every candidate on machine.gpus that pre-flight accepts (TP within a node), in each
    recompute mode (and at TP > 1 with sequence parallelism on and off, if
    `both_sequence_parallel`; else as the config has it): fitting ones first, fastest
    first."""
    bf16 = cfg.train.precision != "fp32"  # auto is bf16 on a GPU
    estimates = []
    found = candidates(cfg, machine, vocab_size, max_micro_batch, recompute, both_sequence_parallel)
    for candidate in found:
        estimates.append(estimate(cfg, candidate, machine, vocab_size, bf16))
    # equally fast (the model has no micro-batch efficiency): the larger micro-batch first
    # (bigger matmuls, fewer accumulation steps), then the leaner
    return sorted(
        estimates,
        key=lambda e: (not e.fits, -e.tokens_per_s, -e.candidate.micro_batch, e.memory.peak),
    )


def candidates(
    cfg: Config,
    machine: Machine,
    vocab_size: int,
    max_micro_batch: int = 64,
    recompute: tuple[str, ...] = RECOMPUTE_MODES,
    both_sequence_parallel: bool = False,
):
    """Each candidate on machine.gpus that belief-lm would run (pre-flight's rules); at
    TP > 1 with sequence parallelism on and off if `both_sequence_parallel`."""
    gpus = machine.gpus
    for tensor in _divisors(gpus):
        if tensor > machine.gpus_per_node or vocab_size % tensor:
            continue  # TP stays within a node; the vocabulary is split over TP ranks
        configured = cfg.parallel.model_copy(update={"tensor": tensor}).sequence_parallel_on
        for sequence_parallel in (
            (True, False) if both_sequence_parallel and tensor > 1 else (configured,)
        ):
            if sequence_parallel and cfg.model.seq_length % tensor:
                continue  # the sequence is split over TP ranks (config's own check)
            yield from _splits(cfg, machine, tensor, sequence_parallel, max_micro_batch, recompute)


def _splits(
    cfg: Config,
    machine: Machine,
    tensor: int,
    sequence_parallel: bool,
    max_micro_batch: int,
    recompute: tuple[str, ...],
):
    """The candidates at one tensor size and sequence-parallel setting."""
    gpus = machine.gpus
    for pipeline in _divisors(gpus // tensor):
        for zero in (0, 1, 2, 3):
            for micro in range(1, max_micro_batch + 1):
                # copies without validation: pre-flight's checks below are the test
                parallel = {"tensor": tensor, "pipeline": pipeline, "zero_stage": zero,
                            "sequence_parallel": sequence_parallel}  # fmt: skip
                trial = cfg.model_copy(
                    update={
                        "parallel": cfg.parallel.model_copy(update=parallel),
                        "train": cfg.train.model_copy(update={"micro_batch_size": micro}),
                    }
                )
                try:
                    dims, accumulation = check_layout(trial, gpus)
                except ValueError:
                    continue
                for mode in recompute:
                    yield Candidate(
                        tensor, pipeline, dims.data, zero, micro, mode, accumulation,
                        sequence_parallel,
                    )  # fmt: skip


def run_vocab_size(cfg: Config) -> int:
    """The embedding rows the run will have: model.vocab_size, or its tokenizer's
    vocabulary (the file's, or data.tokenizer.vocab_size pieces trained) padded."""
    tokenizer = cfg.data.tokenizer
    pieces = tokenizer.vocab_size
    if cfg.model.vocab_size is None and tokenizer.path is not None:
        pieces = Tokenizer(tokenizer.path).vocab_size
    return padded_vocab_size(pieces, cfg.model, 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --------------------------------------------------------------------------- activations


def layer_activations(
    model: ModelConfig,
    tensor: int,
    recompute: str,
    bf16: bool,
    sequence_parallel: bool = False,
    *,
    micro_batch: int,
) -> float:
    """Bytes per token (of the whole sequence) one decoder layer keeps for backward on one
    tensor-parallel rank under `recompute`, with `micro_batch` rows a micro-batch: the
    description's kept tensors (belief_lm.description.layer_saved) that the mode keeps.
    Full recompute keeps the layer's input only; selective keeps the attention core's
    inputs and output and drops what is inside it. With `sequence_parallel` the tensors
    outside the tensor-parallel region are this rank's part of the sequence: 1/tensor of
    them. What is kept per position (RoPE's cos and sin) the rows share: 1/micro_batch of
    it per token."""
    saved = layer_saved(model, tensor, bf16)
    split = tensor if sequence_parallel else 1
    return sum(
        entry.bytes(bf16)
        / (split if entry.sequence_split else 1)
        / (micro_batch if entry.per_position else 1)
        for entry in saved
        if recompute in entry.kept_under
    )


def head_activations(
    model: ModelConfig,
    vocab_size: int,
    tensor: int,
    bf16: bool,
    chunked_loss: bool = False,
    sequence_parallel: bool = False,
) -> float:
    """Bytes per token the last stage keeps after the layers: the final norm's tensors and
    the loss's fp32 softmax over this rank's vocabulary (megatron's vocab-parallel cross
    entropy works in place on the fp32 logits; bf16 logits are dropped once copied). The
    chunked loss (train.loss_chunk_tokens) keeps no logits: the labels (int64) instead.
    With `sequence_parallel` the norm's tensors are 1/tensor of the sequence's, and the
    output GEMM keeps its all-gathered input (the whole sequence's) instead of the norm's
    output."""
    saved = norm_saved(model, "final_norm")
    norm = sum(entry.bytes(bf16) for entry in saved)
    if sequence_parallel:
        output = saved[-1].bytes(bf16)  # norm_saved's last: the norm's output
        norm = (norm - output) / tensor + output
    return norm + (8 if chunked_loss else vocab_size // tensor * 4)


def loss_backward_bytes(
    model: ModelConfig, vocab_size: int, candidate: Candidate, bf16: bool, chunk_tokens: int
) -> float:
    """What the loss's backward allocates beyond head_activations, before the output
    weight's gradient: in bf16 the logits' gradient (the fp32 softmax's, cast). Chunked: one
    chunk's recomputed logits (in bf16 also their fp32 copy; the gradient is made in place
    and cast), the hidden states' gradient of every chunk (concatenated after the last), and
    the output weight's gradient summed over the chunks beside the chunk's own."""
    size = 2 if bf16 else 4
    tokens = candidate.micro_batch * model.seq_length
    rows = vocab_size // candidate.tensor
    if not chunk_tokens:
        return tokens * rows * 2 if bf16 else 0.0
    logits = min(chunk_tokens, tokens) * rows * (size + 4 if bf16 else 4)
    return logits + tokens * model.hidden_size * size + rows * model.hidden_size * size


# --------------------------------------------------------------------------------- memory


def memory(
    cfg: Config, candidate: Candidate, vocab_size: int, bf16: bool, stage: int | None = None
) -> Memory:
    """Peak bytes on one GPU of `stage` (None: the most loaded stage)."""
    if stage is None:
        stages = [memory(cfg, candidate, vocab_size, bf16, s) for s in range(candidate.pipeline)]
        return max(stages, key=lambda m: m.peak)
    model = cfg.model
    description = describe(model, vocab_size)
    params = description.stage_parameters(stage, candidate.tensor, candidate.pipeline)
    layers = stage_layers(model.num_layers, candidate.pipeline)[stage]
    tokens = candidate.micro_batch * model.seq_length
    last = stage == candidate.pipeline - 1
    # 1F1B: stage s holds the activations of up to (stages - s) micro-batches
    in_flight = min(candidate.pipeline - stage, candidate.accumulation)
    split = candidate.sequence_parallel
    per_layer = layer_activations(
        model, candidate.tensor, candidate.recompute, bf16, split, micro_batch=candidate.micro_batch
    )
    layer_activation = in_flight * tokens * layers * per_layer
    chunk = cfg.train.loss_chunk_tokens
    head = 0.0
    if last:
        head = tokens * head_activations(
            model, vocab_size, candidate.tensor, bf16, chunk > 0, candidate.sequence_parallel
        )
    if last and candidate.pipeline > 1:
        # DeepSpeed's pipeline engine keeps each stage's outputs in its pipe buffers, two
        # on the last stage: the logits of this micro-batch and of the one before; with
        # the chunked loss the final norm's output and the output weight, of which only
        # the hidden states of the micro-batch before are not held anyway
        size = 2 if bf16 else 4
        if chunk:
            head += tokens * model.hidden_size * size
        else:
            head += 2 * tokens * vocab_size // candidate.tensor * size
    largest = description.largest_shard(candidate.tensor)
    state = _optimizer_state(params, candidate, bf16, largest)
    held = (
        state.resident
        + (state.accumulated_grads if candidate.accumulation > 1 else 0.0)
        + state.backward_buffers
        + layer_activation
    )
    # backward starts with the loss (loss_backward_bytes), then the output layer's weight
    # gradient (ZeRO 1-2 copy it into their bucket, allocated before it)
    weight_grad = 0.0
    if last and candidate.zero_stage in (0, 3):
        weight_grad = vocab_size // candidate.tensor * model.hidden_size * state.grad_bytes
    loss = loss_backward_bytes(model, vocab_size, candidate, bf16, chunk) if last else 0.0
    backward = held + head + loss + weight_grad
    # recompute then rebuilds one layer's (or attention core's) tensors at a time, the
    # loss's already freed
    transient = 0.0
    if candidate.recompute != "none":
        whole = layer_activations(
            model, candidate.tensor, "none", bf16, split, micro_batch=candidate.micro_batch
        )
        transient = tokens * (whole - per_layer)
        backward = max(backward, held + transient + weight_grad)
    # backward ends with every gradient and, for a tied embedding in one stage, two more
    # of its size: the embedding's own gradient and its sum with the output layer's
    tied = 0.0
    if model.tie_embeddings and candidate.pipeline == 1 and candidate.zero_stage < 3:
        tied = 2 * vocab_size // candidate.tensor * model.hidden_size * state.grad_bytes
    autograd_end = state.resident + state.backward_buffers + state.autograd_grads + tied
    peak = max(backward, autograd_end, state.end_of_backward, state.step, state.startup)
    return Memory(
        stage=stage,
        parameters=params,
        weights=state.weights,
        gradients=state.gradients,
        optimizer=state.optimizer,
        buffers=state.buffers,
        resident=state.resident,
        activations=layer_activation + head,
        recomputed=transient,
        peak=peak,
    )


@dataclass(frozen=True)
class _State:
    """What DeepSpeed holds besides activations, and the peaks of the phases without them."""

    weights: float
    gradients: float
    optimizer: float
    grad_bytes: int
    """Bytes of one gradient element as backward writes it."""
    resident: float
    """Held through forward and backward (weights, optimizer state, ZeRO-3's buffers)."""
    accumulated_grads: float
    """Gradients kept from one micro-batch to the next when accumulating."""
    backward_buffers: float
    """Allocated as backward starts (ZeRO 1-2's reduce bucket and gradient partition)."""
    autograd_grads: float
    """Gradients autograd leaves in the parameters (ZeRO-0) when backward ends."""
    buffers: float
    """DeepSpeed's buffers and the step's temporaries, the largest alive at once."""
    end_of_backward: float
    step: float
    startup: float


def _optimizer_state(params: int, candidate: Candidate, bf16: bool, largest: int) -> _State:
    """DeepSpeed 0.19's engines, as their code allocates and bench/memory.py measured:

    - ZeRO-0, fp32: the torch optimizer on the module's parameters: fp32 gradients and
      moments; the gradient all-reduce (even at DP=1) flattens up to 5e8 of them at once.
    - ZeRO-0, bf16 without a pipeline: DeepSpeed's unfused fp16 optimizer in bf16 (an fp32
      copy of every weight; each step copies the bf16 gradients to fp32); with a pipeline
      its BF16_Optimizer (fp32 masters and moments partitioned over data parallelism, an
      fp32 gradient accumulation buffer).
    - ZeRO 1-2: weights flattened in place; fp32 masters, moments and the reduced gradient
      partition are this rank's 1/DP; in each backward a reduce bucket of 5e8 elements and
      the gradients (ZeRO-1: all of them, ZeRO-2: the partition's; in the model's dtype)
      are allocated at the first gradient.
    - ZeRO-3: weights, fp32 masters and the fp32 gradient partition are 1/DP; the bucket
      is allocated at start-up and kept.

    The optimizer step (torch AdamW, for_loop) takes temporaries of about three fp32
    copies of the tensor it updates (the flat partition from ZeRO-1), twice the largest
    parameter at ZeRO-0."""
    data, zero = candidate.data, candidate.zero_stage
    size = 2 if bf16 else 4
    weights = params * size
    bucket = REDUCE_BUCKET_ELEMENTS * size
    flat = size * min(params, ALLREDUCE_BUCKET_ELEMENTS)
    if zero == 0 and (not bf16 or candidate.pipeline == 1):
        grads = float(size * params)
        # fp32: Adam's moments; bf16 (unfused fp16 optimizer): an fp32 copy too
        opt = (8.0 if not bf16 else 12.0) * params
        fp32_grads = 4.0 * params if bf16 else 0.0  # copied from bf16 at each step
        resident = weights + opt
        return _State(
            weights, grads, opt, size, resident, accumulated_grads=grads, backward_buffers=0.0,
            autograd_grads=grads, buffers=max(flat, fp32_grads + 2 * 4.0 * largest),
            end_of_backward=resident + grads + flat,
            step=resident + grads + fp32_grads + 2 * 4.0 * largest,
            startup=resident + fp32_grads,
        )  # fmt: skip
    if zero == 0:  # bf16 with a pipeline: BF16_Optimizer
        grads, opt = 6.0 * params, 12.0 * params / data  # bf16 + fp32 accumulation
        resident = weights + opt + 4.0 * params
        return _State(
            weights, grads, opt, size, resident, accumulated_grads=0.0, backward_buffers=0.0,
            autograd_grads=2.0 * params, buffers=3 * 4.0 * params / data,
            end_of_backward=resident + 2.0 * params,
            step=resident + 2.0 * params + 3 * 4.0 * params / data,
            startup=resident,
        )  # fmt: skip
    partition = params / data
    opt = 12.0 * partition  # fp32 master + moments
    temps = 3 * 4.0 * partition
    if zero in (1, 2):
        grads = size * partition  # the reduced partition, in the model's dtype
        resident = weights + opt
        # under a pipeline the gradient reduction allocates a second bucket of its own
        buckets = bucket * (2 if candidate.pipeline > 1 else 1)
        # ZeRO-1 stages every gradient during backward, ZeRO-2 only its partition's
        staged = size * params if zero == 1 else grads
        return _State(
            weights, grads, opt, size, resident, accumulated_grads=0.0,
            backward_buffers=buckets + staged, autograd_grads=0.0, buffers=max(buckets, temps),
            end_of_backward=resident + grads,
            step=resident + grads + temps,
            startup=weights + 4.0 * partition,
        )  # fmt: skip
    weights = size * partition  # ZeRO-3
    grads = 4.0 * partition
    resident = weights + opt + grads + bucket
    return _State(
        weights, grads, opt, size, resident, accumulated_grads=0.0, backward_buffers=0.0,
        autograd_grads=0.0, buffers=bucket + temps,
        end_of_backward=resident,
        step=resident + temps,
        startup=resident - 8.0 * partition,  # the moments appear at the first step
    )  # fmt: skip


# ------------------------------------------------------------------------------ step time


def estimate(
    cfg: Config, candidate: Candidate, machine: Machine, vocab_size: int, bf16: bool
) -> Estimate:
    """Memory and step time of one candidate."""
    mem = memory(cfg, candidate, vocab_size, bf16)
    compute, communication = step_time(cfg, candidate, machine, vocab_size, bf16)
    seconds = compute + communication
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    fits = mem.peak + machine.reserve_gb * GB <= machine.memory_gb * GB
    return Estimate(candidate, mem, fits, seconds, compute, communication, tokens / seconds)


def step_time(
    cfg: Config, candidate: Candidate, machine: Machine, vocab_size: int, bf16: bool
) -> tuple[float, float]:
    """(compute, communication) seconds of one optimizer step on every GPU.

    Compute: the step's FLOPs (recompute included) split evenly over the GPUs, at
    machine.mfu of the peak, stretched by 1F1B's bubble ((m + p - 1) / m for m
    micro-batches over p stages). Communication, not overlapped with compute: per
    micro-batch and layer two all-reduces of the [seq, micro, hidden] activations forward
    and two backward (two more with full recompute; with sequence parallelism each is an
    all-gather and a reduce-scatter: the same bytes), belief's [seq, micro, 2] inner
    products (with sequence parallelism: the norms' and row-parallel biases' gradient sums,
    a few vectors of the hidden size per layer, not counted); per step the gradient
    reduction over data parallelism (an all-reduce's volume; ZeRO-2 reduce-scatters every
    micro-batch, ZeRO-3 also gathers the weights for each forward and backward); the
    stage boundaries' activations and their gradients (with sequence parallelism each rank's
    1/TP of the sequence). A collective within a node runs at
    machine.bandwidth_gbs, one across nodes at machine.inter_node_bandwidth_gbs.
    """
    model = cfg.model
    size = 2 if bf16 else 4
    gpus = candidate.tensor * candidate.pipeline * candidate.data
    tokens = cfg.train.global_batch_size * model.seq_length
    flops = tokens * (
        flops_per_token(model, vocab_size)
        + recompute_flops_per_token(model, candidate.recompute)
        + loss_recompute_flops_per_token(model, vocab_size, cfg.train.loss_chunk_tokens)
    )
    micro = candidate.accumulation
    bubble = (micro + candidate.pipeline - 1) / micro
    compute = flops / gpus / (machine.peak_tflops * 1e12 * machine.mfu) * bubble

    per_node = machine.gpus_per_node
    within = machine.bandwidth_gbs * GB
    across = machine.inter_node_bandwidth_gbs * GB
    activation = candidate.micro_batch * model.seq_length * model.hidden_size * size
    layers = stage_layers(model.num_layers, candidate.pipeline)[0]
    tp = 0.0
    if candidate.tensor > 1:
        per_layer = 6 if candidate.recompute == "full" else 4
        belief = model.variant.projects_onto_values
        small = candidate.micro_batch * model.seq_length * 2 * 4 if belief else 0
        volume = layers * (per_layer * activation + 2 * small) + 2 * activation  # + embedding
        tp = micro * _all_reduce(volume, candidate.tensor, within)
    dp = 0.0
    if candidate.data > 1:
        description = describe(model, vocab_size)
        params = max(description.rank_parameters(candidate.tensor, candidate.pipeline))
        grads = params * size
        bandwidth = within if candidate.tensor * candidate.data <= per_node else across
        share = (candidate.data - 1) / candidate.data
        # reduce-scatter + all-gather: an all-reduce's volume, once per step
        times = {0: 2.0, 1: 2.0, 2: micro + 1.0, 3: 3.0 * micro}[candidate.zero_stage]
        dp = times * share * grads / bandwidth
    pp = 0.0
    if candidate.pipeline > 1:
        bandwidth = within if gpus <= per_node else across
        # with sequence parallelism each tensor-parallel rank sends its [s/t, b, h] part
        boundary = activation / candidate.tensor if candidate.sequence_parallel else activation
        pp = 2 * micro * boundary / bandwidth
    return compute, tp + dp + pp


def _all_reduce(volume: float, ranks: int, bandwidth: float) -> float:
    """Seconds of a ring all-reduce of `volume` bytes at a bus bandwidth."""
    return 2 * (ranks - 1) / ranks * volume / bandwidth


# --------------------------------------------------------------------------------- output


def table(estimates: list[Estimate], top: int) -> str:
    """The best `top` candidates that fit, as a text table (GB are 10^9 bytes): one row per
    split, sequence-parallel setting (SP) and recompute mode, at its best micro-batch (the
    first in `estimates`' order)."""
    header = (
        f"{'#':>3} {'TP':>3} {'SP':>3} {'PP':>3} {'DP':>4} {'ZeRO':>4} {'micro':>5} "
        f"{'accum':>5} {'recompute':>9} {'weights':>7} {'grads':>6} {'optim':>6} "
        f"{'buffers':>7} {'activ':>6} {'peak GB':>7} {'step s':>7} {'tokens/s':>10}"
    )
    lines, best = [header], {}
    for e in estimates:
        c = e.candidate
        key = (c.tensor, c.sequence_parallel, c.pipeline, c.data, c.zero_stage, c.recompute)
        if e.fits and key not in best:
            best[key] = e
    for rank, e in enumerate(list(best.values())[:top], start=1):
        c, mem = e.candidate, e.memory
        sequence_parallel = "on" if c.sequence_parallel else "-"
        lines.append(
            f"{rank:>3} {c.tensor:>3} {sequence_parallel:>3} {c.pipeline:>3} {c.data:>4} "
            f"{c.zero_stage:>4} {c.micro_batch:>5} {c.accumulation:>5} {c.recompute:>9} "
            f"{mem.weights / GB:>7.2f} {mem.gradients / GB:>6.2f} {mem.optimizer / GB:>6.2f} "
            f"{mem.buffers / GB:>7.2f} {(mem.activations + mem.recomputed) / GB:>6.2f} "
            f"{mem.peak / GB:>7.2f} {e.step_time_s:>7.2f} {e.tokens_per_s:>10,.0f}"
        )
    return "\n".join(lines)
