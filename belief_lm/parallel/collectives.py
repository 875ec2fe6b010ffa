"""Collectives: the sums the model is handed (our attention never looks up process groups
itself), the tensor-parallel place its vocab-parallel loss runs in (inside megatron's
output layer, whose group it shares), a sum over the model-parallel group (per-layer
numbers each pipeline stage and TP rank holds part of), and where a tensor must be to go
through a group.
An all-reduce over a group of one rank is skipped (`all_reduce_unless_alone`). (Waiting
for rank 0's one-off work is the process grid's: belief_lm.parallel.grid.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from belief_lm.attention import ShardSum


def all_reduce_unless_alone(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
) -> None:
    """dist.all_reduce of `tensor` in place over `group` (None: the whole job), skipped
    where the group has one rank or no process group exists: a reduction over one rank
    returns the tensor as it is, bit for bit, but still calls the backend (gloo's
    thread hand-off on a CPU; a kernel and a stream wait with NCCL). One process trains
    with groups of one everywhere (TP=1, DP=1). Every member of a group decides alike, so
    collectives still pair up across ranks."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def model_parallel_sum(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over megatron's model-parallel group (TP x PP: the ranks that hold
    one replica of the model between them), returned on the host (collective over that
    group; a copy, `values` left as it is)."""
    group = ps.get_model_parallel_group()
    total = values.to(collective_device(group), copy=True)
    all_reduce_unless_alone(total, group=group)
    return total.cpu()


def tensor_parallel_sum(group: dist.ProcessGroup | None) -> ShardSum | None:
    """Sum over the tensor-parallel group with a sum in backward too, or None when the
    group has one rank.

    megatron's reduce_from_tensor_model_parallel_region has an identity backward, which is
    right after a row-parallel matmul but wrong for belief's inner products: every rank
    uses the total for its own heads, so every rank's partial sum receives the gradient of
    all ranks' outputs.
    """
    if group is None or dist.get_world_size(group) == 1:
        return None
    return partial(SumOverRanks.apply, group)


class SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward is the same all-reduce of the gradient. torch's own
    (torch.distributed.nn.functional.all_reduce) is deprecated and refused under
    torch.compile; an in-place c10d all-reduce in an autograd.Function, as megatron's
    regions do it, is traced into the compiled graph (model.compile=layer)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return None, total


def sum_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """Sum over the tensor-parallel group, in backward, the gradient of every parameter of
    `model` marked `sequence_parallel` (megatron's mark: the hidden norms' weights and the
    row-parallel linears' biases under sequence parallelism). Those weights are replicated
    over the group but each rank uses them on its own part of the sequence, so each rank's
    gradient is only its part's. megatron's finalize_model_grads all-reduces them before
    the optimizer step; DeepSpeed does not. A hook on each such parameter sums each
    gradient it receives before it is accumulated, so DeepSpeed (every ZeRO stage, the
    pipeline engine) sees the whole sequence's gradient, as without sequence parallelism.
    One small all-reduce per parameter and micro-batch, in the same order on every rank
    (every rank runs the same backward graph)."""
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False):
            param.register_hook(partial(_summed_over_group, ps.get_tensor_model_parallel_group))


def _summed_over_group(group_of: Callable[[], dist.ProcessGroup], grad: torch.Tensor):
    total = grad.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(total, group=group_of())
    return total


@dataclass(frozen=True)
class TensorParallelPlace:
    """megatron's tensor-parallel group (the process grid made it) and this rank's place
    in it, for code that runs inside megatron's layers and sums over their group (the
    vocab-parallel loss: belief_lm.model.loss)."""

    group: dist.ProcessGroup
    rank: int
    size: int

    @classmethod
    def here(cls) -> TensorParallelPlace:
        return cls(
            ps.get_tensor_model_parallel_group(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )


def data_parallel_rank() -> int:
    """This rank's place among the data-parallel copies of the model (megatron's group, as
    the process grid made it): which micro-batch it measures."""
    return ps.get_data_parallel_rank()


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must be to go through `group`: NCCL reduces only CUDA tensors, gloo
    only CPU ones (a count or a loss total made on the host must move for NCCL)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
