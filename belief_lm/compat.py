"""Every place belief-lm relies on a private part of torch, torch.distributed, megatron-core
or DeepSpeed, in one file.

Each reach says what it assumes and why we need it; `tests/test_compat.py` and
`tests/parallel/test_compat.py` check every assumption against the installed versions, so
an upgrade that breaks one fails there, naming it, rather than somewhere in training.

torch: the multi-tensor in-place multiply (`_foreach_mul_`) our gradient clipping scales
with, the CUDA allocator's history (`torch.cuda.memory._record_memory_history`,
`_dump_snapshot`) a profiled step records, and the rates a learning-rate scheduler reports
(`_last_lr`), which a branch replaces between steps.

torch.distributed:
- The timeout of process groups made without one. torch gives every group made by
  `new_group()` without a `timeout` its backend's default (30 minutes on gloo, 10 on
  NCCL), not the world's: DeepSpeed's pipeline grid, its ZeRO helpers and any group made
  later would wait half an hour for a silent rank. torch reads that default from two
  module globals of `distributed_c10d` at each `new_group()`, and offers no setter.
- Which collective an exception came from: the frames of `distributed_c10d`'s public
  functions hold the collective's name and its `group` argument.

megatron-core: its linears' private GEMM call and dgrad all-reduce flag (RowLinear,
ColumnLinear, for torch.compile), the `_extra_state` entries of its state dicts, and for
sequence parallelism the device its collectives allocate on and its RNG tracker's fork
(`megatron_collectives_on_host`, `untracked_dropout_rng`).

DeepSpeed: where its engine takes a step's gradient norm from, where its pipeline engine
steps the optimizer (a hook before the update: `before_pipeline_update`) and how it
averages a step's loss (`pipeline_step_loss`, there before the update), its bf16 optimizers'
overflow checks and ZeRO-1/2's gradient norm (each replaced by one multi-tensor pass),
which C++ ops it may build on a CPU, the names of its checkpoint files (which
consolidate.py reads directly), the classes it pickles into them, and its own
`torch.load` calls (which pass weights_only=False), routed through belief-lm's
weights-only loader.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import Tensor
from torch.distributed import distributed_c10d

# torch -----------------------------------------------------------------------------------


def scale_in_place(tensors: list[Tensor], factor: float) -> None:
    """Multiply each of `tensors` in place by `factor`, one multi-tensor kernel per device
    and dtype: torch's `_foreach_mul_`, which torch.nn.utils.clip_grad_norm_ calls too (its
    public clip_grads_with_norm_ would compute the factor in the gradients' dtype, not in
    float64 as DeepSpeed's clipping and ours do)."""
    torch._foreach_mul_(tensors, factor)


def norms(tensors: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    """The 2-norm of each of `tensors` (computed and returned in `dtype`, if given), one
    multi-tensor kernel per device and dtype: torch's `_foreach_norm`, the pass
    torch.nn.utils.get_total_norm makes (whose total alone it returns)."""
    if not tensors:
        return []
    return list(
        torch._foreach_norm(tensors, 2, dtype=dtype) if dtype else torch._foreach_norm(tensors)
    )


def record_memory_history(max_entries: int) -> None:
    """Record the CUDA caching allocator's events from now on, keeping the newest
    `max_entries` (torch.cuda.memory's _record_memory_history, the API documented with
    pytorch.org/memory_viz)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_history(path: str) -> None:
    """Write the allocator history recorded so far to `path` (a snapshot pickle for
    pytorch.org/memory_viz), then stop recording."""
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, rates: list[float]) -> None:
    """Make `scheduler.get_last_lr()` (and the state a checkpoint saves) the `rates` its
    optimizer's groups were just given outside a `step()` (belief_lm.train.branch replaces a
    restored schedule): torch keeps them in `_last_lr`, which only `step()` sets."""
    scheduler._last_lr = list(rates)


# torch.distributed -----------------------------------------------------------------------

_C10D_FILE = Path(distributed_c10d.__file__).resolve()


def set_default_group_timeout(timeout: timedelta) -> None:
    """Every process group made from now on without an explicit timeout gets `timeout`
    (gloo and NCCL alike)."""
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def default_group_timeout() -> timedelta:
    """The timeout a group made now without an explicit one would get (gloo)."""
    return distributed_c10d._get_default_timeout(dist.Backend.GLOO)


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta:
    """The timeout of `group`'s host-side (gloo) or CUDA backend (the world if None)."""
    group = group or dist.group.WORLD
    device = torch.device("cpu" if torch.device("cpu") in group._device_types else "cuda")
    return group._get_backend(device).options._timeout


def all_groups() -> list[dist.ProcessGroup]:
    """Every process group this process is a member of (the world first)."""
    world = dist.group.WORLD
    members = [g for g in distributed_c10d._world.pg_map if g is not world and g.rank() >= 0]
    return [world, *members]


def failed_collective(
    traceback: types.TracebackType | None,
) -> tuple[str, dist.ProcessGroup | None, list[types.FrameType]] | None:
    """(the collective's name, its group (None: the world), the frames that led to it,
    outermost first) for an exception raised inside a torch.distributed collective; None
    if it was not. The name is the outermost torch function on the stack
    (`broadcast_object_list`, not the `broadcast` it runs)."""
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for i, frame in enumerate(frames):
        if Path(frame.f_code.co_filename).resolve() == _C10D_FILE:
            callers = [f for f in frames[:i] if "torch/distributed/" not in f.f_code.co_filename]
            return frame.f_code.co_name, frame.f_locals.get("group"), callers
    return None


# megatron-core ---------------------------------------------------------------------------


class _TorchGemmWhereLocal:
    """A megatron linear whose GEMM is torch's F.linear wherever it has nothing to
    communicate: no all-reduce of the input's gradient (allreduce_dgrad: one
    tensor-parallel rank, or a row-parallel layer), no sequence-parallel all-gather, no
    fused or deferred weight-gradient accumulation; the same product otherwise.

    megatron computes the GEMM in its own autograd function (the private `_forward_impl`:
    linear_with_grad_accumulation_and_async_allreduce, megatron/core/tensor_parallel/
    layers.py), whose backward forms the weight's gradient as grad_output^T x input and
    adds the bias apart from the product: on the shared CPU one 4096x768->3072 linear's
    forward and backward took 1.25x torch's (alternating, a loaded machine:
    docs/benchmarks.md). Megatron keeps its function where it communicates."""

    def _forward_impl(self, input: Tensor, weight: Tensor, *args, **kwargs) -> Tensor:
        communicates = kwargs.get("allreduce_dgrad") or kwargs.get("sequence_parallel")
        accumulates = kwargs.get("gradient_accumulation_fusion")
        deferred = kwargs.get("grad_output_buffer") is not None
        if args or communicates or accumulates or deferred or not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        return torch.nn.functional.linear(input, weight, kwargs.get("bias"))


class ColumnGemm(_TorchGemmWhereLocal, ColumnParallelLinear):
    """megatron's ColumnParallelLinear with torch's GEMM where it communicates nothing (at
    one tensor-parallel rank): _TorchGemmWhereLocal."""


class RowGemm(_TorchGemmWhereLocal, RowParallelLinear):
    """megatron's RowParallelLinear with torch's GEMM (its GEMM never communicates: the
    all-reduce or reduce-scatter of its output follows it): _TorchGemmWhereLocal."""


class RowLinear(RowGemm):
    """RowGemm, handing megatron's GEMM (the private `_forward_impl`, where it still runs)
    the layer's own tensor-parallel group: megatron hands it None, which is looked up again
    and warned about (a deprecation) on every call, and a Python warning is a graph break
    under torch.compile (model.compile=layer). The group is unused there (no gradient
    all-reduce in a row layer's GEMM), so the computation is the same."""

    def _forward_impl(self, *args, **kwargs) -> Tensor:
        return super()._forward_impl(*args, **{**kwargs, "tp_group": self.tp_group})


class ColumnLinear(ColumnGemm):
    """ColumnGemm with its input's gradient summed over the
    tensor-parallel ranks by a plain all-reduce (copy_to_tensor_model_parallel_region, as
    megatron does with its `allreduce_dgrad` attribute off) instead of the asynchronous one
    megatron starts inside its GEMM's backward: torch.compile cannot trace that one's
    handle, nor the warning megatron gives with it (graph breaks at TP > 1,
    model.compile=layer). Inductor orders the collective itself. The same sum; nothing
    changes at TP=1."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.allreduce_dgrad = False


def drop_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    """A state-dict post-hook: megatron's linears put `<name>._extra_state: None` into state
    dicts, which DeepSpeed's universal checkpoint converter cannot read; megatron restores
    the None default when loading."""
    for key in [k for k, v in state_dict.items() if k.endswith("._extra_state") and v is None]:
        del state_dict[key]


SEQUENCE_PARALLEL_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
)
"""megatron's modules whose sequence-parallel paths allocate their collectives' outputs
with `device=torch.cuda.current_device()`: the all-gather and reduce-scatter regions
(mappings), the column-parallel GEMM's all-gather and its input gradient's reduce-scatter
(layers), and the global buffer those all-gathers fill (utils.GlobalMemoryBuffer)."""


class _HostCuda:
    """torch.cuda as seen by megatron on a host without CUDA: the current device is the
    CPU; everything else is torch.cuda's own."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


class _HostTorch(types.ModuleType):
    """The torch module with `cuda` replaced by _HostCuda; every other name is torch's."""

    cuda = _HostCuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def megatron_collectives_on_host() -> None:
    """Let megatron's sequence-parallel collectives run where CUDA is not available (gloo
    on CPU: tests, CI): the modules of SEQUENCE_PARALLEL_MODULES see a torch whose
    `cuda.current_device()` is the CPU, so their buffers are allocated there; gloo has
    the all_gather_into_tensor and reduce_scatter_tensor they call. Those allocations are
    the only CUDA-only step of these paths; with CUDA, nothing changes."""
    if torch.cuda.is_available():
        return
    import importlib

    for name in SEQUENCE_PARALLEL_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _HostTorch):
            module.torch = _HostTorch("torch")


def untracked_dropout_rng() -> None:
    """Make megatron's model-parallel RNG fork a no-op unless a tracker with states was set
    up (by megatron's model_parallel_cuda_manual_seed, which belief-lm does not call: it
    is CUDA-only). With sequence parallelism megatron's embedding applies its dropout
    inside `get_cuda_rng_tracker().fork()`, which otherwise fails for want of a state (and
    of CUDA). Without the fork that dropout draws from the default generator, as the
    layers' own dropout does in the same sequence-parallel region; at dropout 0 (every
    shipped config) nothing is drawn at all. megatron's own no-op tracker is the one it
    builds for inference."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    if tracker is not None and tracker.get_states():
        return
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def lean_rotary_embedding() -> None:
    """Make megatron's unfused RoPE (rope_utils._apply_rotary_pos_emb_bshd, what
    apply_rotary_pos_emb runs without TransformerEngine's fusion) skip two passes that
    change no value: cos and sin multiplied by mscale when it is 1, and the rotated heads
    concatenated with the dimensions RoPE leaves alone when there are none (a copy of q
    and of k). Bit for bit megatron's result and gradient (x * 1.0 is x; a concatenation
    with nothing is a copy), 4 ops fewer per layer for q and k; any other case (a scale,
    a partial rotary dimension, multi-latent attention) runs megatron's. Idempotent."""
    from megatron.core.models.common.embeddings import rope_utils

    megatrons = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(megatrons, "lean", False):
        return

    def apply(
        t: Tensor,
        freqs: Tensor,
        rotary_interleaved: bool = False,
        multi_latent_attention: bool = False,
        mscale: float = 1.0,
    ) -> Tensor:
        if multi_latent_attention or mscale != 1.0 or freqs.shape[-1] != t.shape[-1]:
            return megatrons(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        return t * cos + rope_utils._rotate_half(t, rotary_interleaved) * sin

    apply.lean, apply.megatrons = True, megatrons
    rope_utils._apply_rotary_pos_emb_bshd = apply


# DeepSpeed -------------------------------------------------------------------------------


def report_grad_norm(optimizer: torch.optim.Optimizer, norm: float) -> None:
    """Hand DeepSpeed's engine the gradient norm we computed for a step: after a step, the
    engine takes its get_global_grad_norm() from the optimizer's `_global_grad_norm` where
    it has one (its own clipping drops the norm at ZeRO-0 in fp32, so we clip ourselves)."""
    optimizer._global_grad_norm = norm


def any_nonfinite(tensors: list[Tensor]) -> Tensor:
    """Whether any of `tensors` holds a NaN or an infinity, as a one-element bool tensor on
    their device, from one multi-tensor pass (`norms`): such a value makes its tensor's
    norm NaN or infinite, as does a finite gradient too large for the norm's dtype (an
    overflow too)."""
    return torch.stack(norms(tensors)).isfinite().all().logical_not().reshape(1)


def one_pass_overflow_check(optimizer) -> None:
    """Make the overflow check of DeepSpeed's bf16/fp16 optimizer one pass over the
    gradients; an optimizer of another kind is left alone. DeepSpeed checks each gradient
    apart, with about a dozen kernels (amax, amin, isfinite, ...): 2,682 launches a step
    against a plain loop's 546 at gpt2-124m on an H200 (docs/benchmarks.md).
    - ZeRO-1/2 (`DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial`): over this
      rank's partition of every group; a one-element bool tensor, as DeepSpeed's, which
      its `has_overflow` all-reduces over data and model parallelism and reads (one sync).
    - ZeRO-0 (`FP16_UnfusedOptimizer`, whose `CheckOverflow.has_overflow_serial` also reads
      each tensor's verdict on the host: a sync per gradient): a Python bool, as there."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):

        def partitioned(zero=optimizer) -> Tensor:
            grads = [
                grad
                for group in range(len(zero.bit16_groups))
                for grad in zero.averaged_gradients[group]
                if grad is not None
            ]
            if not grads:
                return torch.zeros(1, dtype=torch.bool, device=zero.device)
            return any_nonfinite(grads)

        optimizer.has_overflow_partitioned_grads_serial = partitioned
    elif isinstance(optimizer, FP16_UnfusedOptimizer):

        def serial(params) -> bool:
            grads = [p.grad for p in params if p.grad is not None]
            return bool(grads) and bool(any_nonfinite(grads))

        optimizer.overflow_checker.has_overflow_serial = serial


def one_pass_grad_norm(optimizer) -> None:
    """Make ZeRO-1/2's gradient norm (`get_grad_norm_direct`: for clipping, the overflow
    verdict in fp32 and the engine's reported norm) one multi-tensor pass over this rank's
    partition instead of a cast and a norm per gradient (2 kernels per tensor), by
    DeepSpeed's own rules, which its source must still show (tests/test_compat.py): its
    padding left out, a pipeline-replicated weight counted on no stage, a weight that
    tensor parallelism does not split counted on model-parallel rank 0 only, the squares
    summed over data then model parallelism, an infinite or NaN norm reported as -1. Norms
    of another order take DeepSpeed's path; an optimizer of another kind is left alone."""
    from deepspeed import comm
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace as mask_invalid
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return
    zero, deepspeeds = optimizer, optimizer.get_grad_norm_direct

    def get_grad_norm_direct(gradients, params, norm_type=2) -> Tensor:
        if float(norm_type) != 2.0:
            return deepspeeds(gradients, params, norm_type)
        unpadded = (g for g in gradients if not getattr(g, "_zero_padding", False))
        counted = [
            g
            for g, p in zip(unpadded, params)  # noqa: B905 (DeepSpeed's pairing)
            if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
            and (is_model_parallel_parameter(p) or zero.model_parallel_rank == 0)
        ]
        squares = torch.zeros((), dtype=torch.float32, device=zero.device)
        if counted:
            squares = torch.stack(norms(counted, torch.float32)).square().sum()
        if dist.get_world_size(zero.dp_process_group) > 1:  # as the next call skips
            comm.all_reduce(squares, op=comm.ReduceOp.SUM, group=zero.dp_process_group)
        zero._model_parallel_all_reduce(tensor=squares, op=comm.ReduceOp.SUM)
        total = squares.sqrt()
        mask_invalid(total, device=zero.device)
        return total

    zero.get_grad_norm_direct = get_grad_norm_direct


def before_pipeline_update(engine, hook: Callable[[], object]) -> None:
    """Call `hook` inside DeepSpeed's pipeline engine between a step's last backward and its
    optimizer's update, on every stage: train_batch runs the whole schedule, update
    included, and offers no hook. The schedule's last instructions reduce the gradients
    over data parallelism and between tied stages, then OptimizerStep, which the engine
    runs as `_exec_optimizer_step`, calling `self._take_model_step` (clipping and the
    optimizer's step): replaced here by instance attribute, `hook` first."""
    take_model_step = engine._take_model_step

    def hooked(*args, **kwargs):
        hook()
        return take_model_step(*args, **kwargs)

    engine._take_model_step = hooked


def pipeline_step_loss(engine) -> Tensor:
    """The step's loss on every stage, from inside a pipeline engine's train_batch once the
    schedule's last backward ran (before_pipeline_update): the last stage's sum over the
    micro-batches scaled by the accumulation steps, averaged over data parallelism and
    broadcast over the pipeline, as train_batch returns it afterwards: its own
    `_aggregate_total_loss`, which train_batch then runs again (the same numbers, from the
    same total; one small broadcast and all-reduce more per step)."""
    return engine._aggregate_total_loss()


def disable_shm_comm() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce: a minute
    of a core per process group start (a C++ build whose command differs, e.g. another
    venv's path), for its inference all-reduce, which training never calls (gloo does
    ours). DeepSpeed reads which ops may build from `deepspeed.ops.__compatible_ops__`."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def model_states_name(tensor_rank: int) -> str:
    """The module's file of one tensor-parallel rank (no pipeline) in a DeepSpeed
    checkpoint directory."""
    return f"mp_rank_{tensor_rank:02d}_model_states.pt"


def layer_states_pattern(tensor_rank: int) -> str:
    """A glob for a pipeline's layer files of one tensor-parallel rank (each holding one
    layer of the PipelineModule: `layer_<index>-model_<rank>-model_states.pt`)."""
    return f"layer_*-model_{tensor_rank:02d}-model_states.pt"


def layer_index(name: str) -> int:
    """The PipelineModule layer index of a layer file's name."""
    return int(name.split("-")[0].removeprefix("layer_"))


def optim_states_pattern(model_rank: int, kind: str = "optim") -> str:
    """A glob for the ZeRO files of one model-parallel rank, one per data-parallel rank:
    `*zero_pp_rank_<dp>_mp_rank_<mp>_<kind>_states.pt` (kind 'optim', 'model' or '*')."""
    return f"*zero_pp_rank_*_mp_rank_{model_rank:02d}_{kind}_states.pt"


def zero_rank(name: str) -> int:
    """The data-parallel rank of a ZeRO file's name."""
    return int(re.search(r"zero_pp_rank_(\d+)_", name)[1])


def deepspeed_checkpoint_types() -> list[type]:
    """The classes DeepSpeed pickles into its checkpoint files besides tensors and plain
    values: its ZeRO and bf16 optimizers' states hold a LossScaler (also in fp32 and bf16),
    the ZeRO stage as a ZeroStageEnum, and each parameter's place in the flat partition as a
    fragment_address. Each is rebuilt from plain values (an enum member by value, the others
    by setting their attributes), which runs none of the file's code."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


DEEPSPEED_DIRECT_LOADS = (
    "deepspeed.checkpoint.universal_checkpoint",
    "deepspeed.runtime.base_optimizer",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.checkpoint.ds_to_universal",
    "deepspeed.checkpoint.deepspeed_checkpoint",
    "deepspeed.checkpoint.zero_checkpoint",
    "deepspeed.utils.zero_to_fp32",
)
"""DeepSpeed's modules that read checkpoint files with `torch.load(..., weights_only=False)`
themselves instead of through the engine's checkpoint engine: loading a universal
checkpoint (its ZeRO optimizers), converting to one (ds_to_universal and the readers it
uses), and zero_to_fp32 (consolidate.py's ZeRO-3 weights)."""


@contextlib.contextmanager
def deepspeed_loads_through(load: Callable) -> Iterator[None]:
    """Within the block, every `torch.load` call (DeepSpeed's direct loads of
    DEEPSPEED_DIRECT_LOADS among them) goes to `load(f, map_location, mmap=...)` instead,
    whatever weights_only it asks for. DeepSpeed has no argument for a loader: its modules
    call `torch.load` by its name in the torch module, which is replaced for the duration
    (for the whole process: nothing else loads while a checkpoint is being read).
    `torch.serialization.load`, the same function under its own name, stays as it is."""
    original = torch.load

    def routed(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None,
               **pickle_load_args):  # fmt: skip
        return load(f, map_location, mmap=bool(mmap))

    torch.load = routed
    try:
        yield
    finally:
        torch.load = original
