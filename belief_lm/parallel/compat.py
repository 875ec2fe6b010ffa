"""Where belief-lm relies on torch.distributed internals, in one place (tests/parallel/
test_compat.py fails with a clear message on a torch whose internals moved).

- The timeout of process groups made without one. torch gives every group made by
  `new_group()` without a `timeout` its backend's default (30 minutes on gloo, 10 on
  NCCL), not the world's: DeepSpeed's pipeline grid, its ZeRO helpers and any group made
  later would wait half an hour for a silent rank. torch reads that default from two
  module globals of `distributed_c10d` at each `new_group()`, and offers no setter.
- Which collective an exception came from: the frames of `distributed_c10d`'s public
  functions hold the collective's name and its `group` argument.
"""

from __future__ import annotations

import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

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
