"""megatron's process groups in the shape DeepSpeed's engine asks for (`mpu=`).

DeepSpeed calls get_model_parallel_{rank,world_size,group} and
get_data_parallel_{rank,world_size,group} (ZeRO partitioning, gradient-norm reduction,
checkpoint names); megatron's parallel_state has no get_model_parallel_* names, so this
maps "model parallel" to megatron's tensor x pipeline group.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps


class MegatronMPU:
    """Adapter passed as deepspeed.initialize(mpu=MegatronMPU())."""

    get_data_parallel_group = staticmethod(ps.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(ps.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(ps.get_data_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(ps.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(ps.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(ps.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_src_rank = staticmethod(ps.get_tensor_model_parallel_src_rank)
    get_pipeline_model_parallel_group = staticmethod(ps.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(ps.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(ps.get_pipeline_model_parallel_world_size)
    get_model_parallel_group = staticmethod(ps.get_model_parallel_group)

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank(ps.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size(ps.get_model_parallel_group())
