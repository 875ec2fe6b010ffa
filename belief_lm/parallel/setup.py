"""Joining the job: torch.distributed's default process group (through DeepSpeed's
start-up, which its engines expect). The groups made on top of it are the process grid's
(belief_lm.parallel.grid)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from belief_lm import compat
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
