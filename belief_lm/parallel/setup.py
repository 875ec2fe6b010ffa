"""Process groups: torch.distributed, then megatron's tensor/pipeline/data groups.

megatron's parallel_state orders ranks tp-cp-ep-dp-pp (TP innermost, PP outermost), the
same layout as DeepSpeed's PipeModelDataParallelTopology; the 3D engine asserts it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from belief_lm import compat
from belief_lm.parallel.dims import Layout, ParallelDims
from belief_lm.parallel.env import ProcessEnv
from belief_lm.runtime import backend_for


def init_distributed(env: ProcessEnv, device: torch.device, timeout_s: float = 600) -> None:
    """Join the job's process group (nccl on GPU, gloo on CPU) unless already joined.

    The timeout bounds how long a rank waits in a collective on a silent peer before
    failing: the world's, and that of every group made later (megatron's get it passed,
    DeepSpeed's and the rest by default). On NCCL the wait is done by torch's watchdog
    thread, which ends the process at the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=1:
    abort the communicators, then exit) instead of leaving it hanging on the GPU.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    compat.set_default_group_timeout(timeout)  # before DeepSpeed's first group
    if device.type == "cuda":  # read when the NCCL group is made; a setting of the user's stays
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    import deepspeed

    if device.type == "cpu":
        compat.disable_shm_comm()  # a C++ build DeepSpeed's CPU backend would start for nothing
    env.export()
    deepspeed.init_distributed(
        dist_backend=backend_for(device),
        auto_mpi_discovery=False,
        timeout=timeout,
    )


def init_model_parallel(tensor: int, pipeline: int) -> Layout:
    """Create (or reuse, if the sizes match) megatron's process groups."""
    data = ParallelDims(dist.get_world_size(), tensor, pipeline).data
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
            tensor_model_parallel_size=tensor,
            pipeline_model_parallel_size=pipeline,
            # the job's collective timeout (megatron takes minutes; a fraction is fine)
            distributed_timeout_minutes=compat.default_group_timeout().total_seconds() / 60,
        )
    return Layout(
        tensor=tensor,
        pipeline=pipeline,
        data=data,
        tensor_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_rank=ps.get_pipeline_model_parallel_rank(),
        data_rank=ps.get_data_parallel_rank(),
    )


def single_process_groups() -> Layout:
    """The process groups of a one-process job (generation, export, tests): megatron's
    layers need them even here. A gloo group of world size 1 unless this process is in
    one already; its in-memory store needs no port, and it skips DeepSpeed's start-up,
    which builds its CPU communication op every time (seconds to a minute)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_model_parallel(1, 1)
