"""`belief-lm launch local`: torchrun on this machine, launch.tasks_per_node processes (one
per GPU by default)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from belief_lm.config import Config


def torchrun_command(cfg: Config, train_args: list[str]) -> list[str]:
    """The torchrun command line for `belief-lm train <train_args>` on this machine."""
    if cfg.launch.nodes != 1:
        raise ValueError(
            f"launch.nodes is {cfg.launch.nodes}, but launch local runs on this machine "
            "only (use launch slurm for several nodes)"
        )
    return [
        sys.executable,  # this environment's torchrun and belief-lm, whatever PATH says
        "-m",
        "torch.distributed.run",
        "--standalone",  # single node: a private rendezvous on a free local port
        f"--nproc-per-node={cfg.launch.tasks}",
        "-m",
        "belief_lm.cli",
        "train",
        *train_args,
    ]
