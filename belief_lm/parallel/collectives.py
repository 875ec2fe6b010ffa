"""Collectives: the sums the model is handed (it never looks up process groups itself),
the rank-zero-first pattern for work that fills a cache the other ranks then read, and
work done on rank 0 alone while the others wait for its outcome."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import TypeVar

import torch
import torch.distributed as dist

from belief_lm.attention import ShardSum
from belief_lm.errors import BAD_INPUT, BadInput
from belief_lm.parallel import peers

T = TypeVar("T")

RANK_ZERO_FIRST_TIMEOUT = timedelta(hours=2)
"""How long the other ranks wait for rank 0's first run (training a tokenizer on a large
sample, converting a large checkpoint) outside a training run; a training run waits
parallel.rank_zero_wait_s (belief_lm.parallel.peers)."""


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


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must be to go through `group`: NCCL reduces only CUDA tensors, gloo
    only CPU ones (a count or a loss total made on the host must move for NCCL)."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_zero_first(work: Callable[[], T]) -> T:
    """`work()` on rank 0, then on every other rank once rank 0 is done. For idempotent work
    whose first run fills a cache the others then read (a trained tokenizer, a checkpoint
    converted to the universal form). Collective; without a process group it just runs.

    The wait is on a gloo group of its own with a long timeout (parallel.rank_zero_wait_s
    in a training run): the job's default group may be NCCL (a GPU barrier) with a
    timeout sized for collectives, not for this. Meanwhile the others watch rank 0's
    heartbeat: a rank 0 silent for parallel.timeout_s is lost (peers.PeerLost) long
    before the wait would end. If rank 0's run fails, every rank fails at once with its
    message (bad input stays bad input, belief_lm.errors.BadInput, reported as such
    everywhere) instead of waiting.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    group = _waiting_group()
    result, failure = None, None
    if dist.get_rank() == 0:
        try:
            result = work()
        except Exception as err:  # told to the others below, then raised here
            failure = err
    done = torch.zeros(1)
    waiting = dist.broadcast(done, src=0, group=group, async_op=True)
    peers.wait_for_rank_zero(waiting, "rank_zero_first's wait for rank 0")
    outcome = [None if failure is None else (isinstance(failure, BAD_INPUT), str(failure))]
    dist.broadcast_object_list(outcome, src=0, group=group)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        bad_input, message = outcome[0]
        raise (BadInput if bad_input else RuntimeError)(f"on rank 0: {message}")
    return result if dist.get_rank() == 0 else work()


_waiting: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
"""The world and the gloo group rank_zero_first waits in."""


def _waiting_group() -> dist.ProcessGroup:
    """rank_zero_first's gloo group: made at its first call in a world (collective, as every
    call is) and kept for the world's life. Destroying it after each wait deadlocked on
    torch 2.6: the group's destructor joins its worker threads holding the GIL while a
    worker, freeing the finished broadcast's tensors, waits for the GIL. Its timeout is a
    minute past parallel.rank_zero_wait_s, so the watch's clearer message comes first."""
    global _waiting
    world = dist.group.WORLD
    if _waiting is None or _waiting[0] is not world:
        watch = peers.current()
        timeout = RANK_ZERO_FIRST_TIMEOUT
        if watch is not None:
            timeout = timedelta(seconds=watch.rank_zero_wait_s + 60)
        group = dist.new_group(backend="gloo", timeout=timeout)
        _waiting = (world, peers.name_group(group, "rank_zero_first's group"))
    return _waiting[1]


def on_rank_zero(work: Callable[[], T]) -> T | None:
    """`work()` on rank 0 while the other ranks wait (collective, as rank_zero_first: if it
    fails, every rank fails with its message); None on the other ranks."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank_zero_first(lambda: work() if rank == 0 else None)
