"""What several commands share: their common arguments, the run config they name, and the
console set-up before heavy work."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from belief_lm import logs
from belief_lm.config import Config, load_config
from belief_lm.parallel.env import LaunchEnvError, detect

AddCommand = Callable[..., argparse.ArgumentParser]
"""What a command module adds its commands with: `add_parser` of argparse's subparsers
(name, help=..., description=...) -> the command's parser."""


def add_config(sub: argparse.ArgumentParser) -> None:
    """--config and the dotted overrides applied after it."""
    sub.add_argument("--config", "-c", help="run config YAML (see configs/)")
    sub.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides, applied after the file",
    )


def add_checkpoint(sub: argparse.ArgumentParser) -> None:
    """--checkpoint: a step directory, or a run directory's newest intact checkpoint."""
    sub.add_argument(
        "--checkpoint", required=True, metavar="DIR",
        help="a checkpoint step directory, e.g. runs/tiny/checkpoints/step_000300, or a run "
        "directory (runs/tiny): its newest intact checkpoint",
    )  # fmt: skip
    add_trust(sub)


def add_trust(sub: argparse.ArgumentParser) -> None:
    """--trust-checkpoint: the opt-in to read a checkpoint's files with pickle."""
    sub.add_argument(
        "--trust-checkpoint", action="store_true",
        help="load checkpoint files holding more than a checkpoint may (an earlier belief-lm's) "
        "with pickle, which can run code: only for checkpoints you made yourself (train: sets "
        "checkpoint.trust)",
    )  # fmt: skip


def add_branch(sub: argparse.ArgumentParser) -> None:
    """--branch: start a new run from another run's checkpoint (train, launch)."""
    sub.add_argument(
        "--branch", metavar="CKPT",
        help="start a new run (its own run.output_dir) from another run's checkpoint step "
        "directory, continuing it as a resume would; the overrides may change the schedule "
        "and what changes neither the model, the tokenizer nor the data order (sets "
        "checkpoint.branch; without --config the checkpoint's config.yaml is the base)",
    )  # fmt: skip


def run_config(args: argparse.Namespace) -> Config:
    """The run config that --config and the overrides give (ConfigError naming the key);
    with --branch and no --config, the branch checkpoint's own config.yaml (the parent's
    effective config) is the base (and becomes args.config, for the ranks a launch starts)."""
    if getattr(args, "branch", None) and args.config is None:
        args.config = str(Path(args.branch).expanduser() / "config.yaml")
    return load_config(args.config, args.overrides)


def quiet_libraries() -> None:
    """Our log lines on the first rank; the libraries' known chatter off the console."""
    try:
        rank = detect().rank  # RANK is not set yet under SLURM or MPI
    except LaunchEnvError:
        rank = 0  # train() reports the problem
    logs.configure(rank)
