"""One layout, two descriptions: megatron's parallel_state and DeepSpeed's topology."""

from __future__ import annotations

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state as ps

from belief_lm.parallel.dims import Layout


def deepspeed_topology(layout: Layout) -> PipeModelDataParallelTopology:
    """DeepSpeed's grid (axes pipe, data, model: model fastest) for `layout`."""
    return PipeModelDataParallelTopology(
        num_pp=layout.pipeline, num_mp=layout.tensor, num_dp=layout.data
    )


def assert_same_layout(topology: PipeModelDataParallelTopology) -> None:
    """Fail unless DeepSpeed's grid puts this rank in the same tensor, data and pipeline
    groups, at the same coordinates, as megatron's parallel_state (TP innermost, PP
    outermost in both)."""
    rank = dist.get_rank()
    coord = topology.get_coord(rank)
    expected = {
        "model": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()),
        "data": (ps.get_data_parallel_rank(), ps.get_data_parallel_group()),
        "pipe": (ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()),
    }
    for axis, (megatron_rank, group) in expected.items():
        members = next(g for g in topology.get_axis_comm_lists(axis) if rank in g)
        megatron_members = dist.get_process_group_ranks(group)
        if getattr(coord, axis) != megatron_rank or sorted(members) != sorted(megatron_members):
            raise RuntimeError(
                f"rank {rank}: DeepSpeed's {axis} axis (coordinate {getattr(coord, axis)}, "
                f"group {members}) disagrees with megatron's ({megatron_rank}, "
                f"{megatron_members})"
            )
