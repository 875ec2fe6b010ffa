"""Whole tensors from tensor-parallel shards (for comparisons, exports, conversions).

A shard is split as megatron splits the parameter (partition_dim, partition_stride: the
Split of the weight in belief_lm.description); `join_shards` and `shard_piece` are that
layout, for live parameters here and for a checkpoint's slices in consolidate."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import Tensor

from belief_lm.parallel.collectives import collective_device


def gather_tensor_parallel(shard: Tensor, like: torch.nn.Parameter) -> Tensor:
    """The full tensor of which `shard` is this rank's piece, sharded as megatron shards
    parameter `like` (its tensor_model_parallel / partition_dim / partition_stride).

    With stride s each rank holds s chunks: chunk j of rank r is piece j*TP + r of the full
    tensor (megatron's layout for the gated MLP's [gate; up] weight). Collective over the
    TP group; returns `shard` itself for replicated parameters.
    """
    group = ps.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    if world == 1 or not getattr(like, "tensor_model_parallel", False):
        return shard
    pieces = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(pieces, shard.contiguous(), group=group)
    return join_shards(pieces, like.partition_dim, getattr(like, "partition_stride", 1))


def join_shards(pieces: list[Tensor], dim: int, stride: int = 1) -> Tensor:
    """The whole tensor from every TP rank's piece, in rank order: split along `dim` with
    `stride` chunks per rank (chunk j of rank r is piece j*TP + r of the whole tensor;
    megatron's layout for the gated MLP's [gate; up] weight)."""
    chunks = [piece.chunk(stride, dim=dim) for piece in pieces]
    return torch.cat([chunks[r][j] for j in range(stride) for r in range(len(pieces))], dim=dim)


def shard_piece(full: Tensor, dim: int, stride: int, rank: int, world: int) -> Tensor:
    """TP rank `rank`'s piece of `full` (join_shards' inverse)."""
    pieces = full.chunk(world * stride, dim=dim)
    return torch.cat([pieces[j * world + rank] for j in range(stride)], dim=dim)


def counted_once(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of `param` counts toward a whole-model sum (parameters, the
    gradient norm): tensor-parallel shards on every TP rank (each holds a slice),
    replicated weights on TP rank 0 only, and never the output stage's copy of a tied
    embedding (marked `pipeline_duplicate` by belief_lm.model.pipeline)."""
    if getattr(param, "pipeline_duplicate", False):
        return False
    return tp_rank == 0 or getattr(param, "tensor_model_parallel", False)


def count_model_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters of the whole model, summed over this rank's tensor- and
    pipeline-parallel peers (collective over megatron's model-parallel group when it
    exists; a tied weight counts once)."""
    grouped = ps.model_parallel_is_initialized() and dist.is_initialized()
    tp_rank = ps.get_tensor_model_parallel_rank() if grouped else 0
    count = sum(p.numel() for p in model.parameters() if counted_once(p, tp_rank))
    if not grouped:
        return count
    group = ps.get_model_parallel_group()
    # an explicit device: also right under a meta-device context (models built on meta)
    total = torch.tensor(count, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(total, group=group)
    return int(total.item())


def full_state_dict(module: torch.nn.Module, rename=None) -> dict[str, Tensor]:
    """This rank's parameters as whole tensors (TP shards gathered), keyed by
    `rename(name)` (e.g. pipeline names to BeliefLM's; None drops the entry). Collective
    over the TP group: every TP rank must call it."""
    state = {}
    for name, param in module.named_parameters():
        full = gather_tensor_parallel(param.detach(), param)
        key = rename(name) if rename else name
        if key is not None:
            state[key] = full
    return state


def shard_tensor_parallel(full: Tensor, like: torch.nn.Parameter) -> Tensor:
    """This rank's piece of `full` as megatron shards `like` (inverse of
    gather_tensor_parallel; no communication)."""
    group = ps.get_tensor_model_parallel_group()
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1 or not getattr(like, "tensor_model_parallel", False):
        return full
    stride, rank = getattr(like, "partition_stride", 1), ps.get_tensor_model_parallel_rank()
    return shard_piece(full, like.partition_dim, stride, rank, world)
