"""Collectives the model is handed (it never looks up process groups itself)."""

from __future__ import annotations

from functools import partial

import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce

from belief_lm.attention import ShardSum


def tensor_parallel_sum(group: dist.ProcessGroup | None) -> ShardSum | None:
    """Sum over the tensor-parallel group with a sum in backward too (torch's autograd
    all_reduce), or None when the group has one rank.

    megatron's reduce_from_tensor_model_parallel_region has an identity backward, which is
    right after a row-parallel matmul but wrong for belief's inner products: every rank
    uses the total for its own heads, so every rank's partial sum receives the gradient of
    all ranks' outputs.
    """
    if group is None or dist.get_world_size(group) == 1:
        return None
    return partial(all_reduce, group=group)
