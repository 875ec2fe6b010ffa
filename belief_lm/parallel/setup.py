"""Process groups: torch.distributed, then megatron's tensor/pipeline/data groups.

megatron's parallel_state orders ranks tp-cp-ep-dp-pp (TP innermost, PP outermost), the
same layout as DeepSpeed's PipeModelDataParallelTopology; the 3D engine asserts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from belief_lm.runtime import backend_for
from launcher.env import ProcessEnv


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates in the tensor x pipeline x data grid."""

    tensor: int
    pipeline: int
    data: int
    tensor_rank: int
    pipeline_rank: int
    data_rank: int


def check_layout(world_size: int, tensor: int, pipeline: int) -> int:
    """Data-parallel size for this world, or a ValueError naming the options to change."""
    if world_size % (tensor * pipeline):
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tensor ({tensor}) x "
            f"parallel.pipeline ({pipeline})"
        )
    return world_size // (tensor * pipeline)


def init_distributed(env: ProcessEnv, device: torch.device, timeout_s: float = 600) -> None:
    """Join the job's process group (nccl on GPU, gloo on CPU) unless already joined.

    The timeout bounds how long a rank waits on a dead peer before failing.
    """
    if dist.is_initialized():
        return
    import deepspeed

    env.export()
    deepspeed.init_distributed(
        dist_backend=backend_for(device),
        auto_mpi_discovery=False,
        timeout=timedelta(seconds=timeout_s),
    )


def init_model_parallel(tensor: int, pipeline: int) -> Layout:
    """Create (or reuse, if the sizes match) megatron's process groups."""
    data = check_layout(dist.get_world_size(), tensor, pipeline)
    ps = parallel_state
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tensor
            and ps.get_pipeline_model_parallel_world_size() == pipeline
        )
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline
        )
    return Layout(
        tensor=tensor,
        pipeline=pipeline,
        data=data,
        tensor_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_rank=ps.get_pipeline_model_parallel_rank(),
        data_rank=ps.get_data_parallel_rank(),
    )
