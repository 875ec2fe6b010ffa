"""Every place belief-lm relies on a private part of megatron-core or DeepSpeed, in one file.

Each reach below says what it assumes and why we need it; `tests/test_compat.py` checks
every assumption against the installed versions (megatron-core 0.16, DeepSpeed 0.19), so an
upgrade that breaks one fails there, naming it, rather than somewhere in training.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import Tensor


class RowLinear(RowParallelLinear):
    """megatron's RowParallelLinear, handing its GEMM (the private `_forward_impl`) the
    layer's own tensor-parallel group: megatron hands it None, which is looked up again and
    warned about (a deprecation) on every call, and a Python warning is a graph break under
    torch.compile (model.compile=layer). The group is unused there (no gradient all-reduce
    in a row layer's GEMM), so the computation is the same."""

    def _forward_impl(self, *args, **kwargs) -> Tensor:
        return super()._forward_impl(*args, **{**kwargs, "tp_group": self.tp_group})


class ColumnLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear with its input's gradient summed over the
    tensor-parallel ranks by a plain all-reduce (copy_to_tensor_model_parallel_region, as
    megatron does with its `allreduce_dgrad` attribute off) instead of the asynchronous one
    megatron starts inside its GEMM's backward: torch.compile cannot trace that one's
    handle, nor the warning megatron gives with it (graph breaks at TP > 1,
    model.compile=layer). Inductor orders the collective itself. The same sum; nothing
    changes at TP=1."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.allreduce_dgrad = False


def drop_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    """A state-dict post-hook: megatron's linears put `<name>._extra_state: None` into state
    dicts, which DeepSpeed's universal checkpoint converter cannot read; megatron restores
    the None default when loading."""
    for key in [k for k, v in state_dict.items() if k.endswith("._extra_state") and v is None]:
        del state_dict[key]


def report_grad_norm(optimizer: torch.optim.Optimizer, norm: float) -> None:
    """Hand DeepSpeed's engine the gradient norm we computed for a step: after a step, the
    engine takes its get_global_grad_norm() from the optimizer's `_global_grad_norm` where
    it has one (its own clipping drops the norm at ZeRO-0 in fp32, so we clip ourselves)."""
    optimizer._global_grad_norm = norm


def disable_shm_comm() -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce: a minute
    of a core per process group start (a C++ build whose command differs, e.g. another
    venv's path), for its inference all-reduce, which training never calls (gloo does
    ours). DeepSpeed reads which ops may build from `deepspeed.ops.__compatible_ops__`."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
