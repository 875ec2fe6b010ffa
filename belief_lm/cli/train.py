"""`belief-lm train`: pretrain a model (belief_lm.train.loop.train)."""

from __future__ import annotations

import argparse
import logging

from belief_lm import exit_codes
from belief_lm.cli.arguments import (
    AddCommand,
    add_branch,
    add_config,
    add_trust,
    quiet_libraries,
    run_config,
)


def add_to(add: AddCommand) -> None:
    sub = add("train", help="pretrain a model", description="pretrain a model")
    sub.add_argument(
        "--resume", metavar="auto|never|DIR",
        help="checkpoint to continue from (sets checkpoint.resume; default auto)",
    )  # fmt: skip
    add_branch(sub)
    add_trust(sub)
    add_config(sub)
    sub.set_defaults(run=train)


def train(args: argparse.Namespace) -> int:
    """Train to train.max_steps; a run that stops early raises what ends it (cli.exits)."""
    cfg = run_config(args)
    quiet_libraries()
    from belief_lm.train.signals import StopRequests

    # caught from the first moment (before the heavy imports), then ignored until the process
    # ends: no signal during start-up or after the save may kill the rank
    stop = StopRequests().catch()
    from belief_lm.train.loop import train

    try:
        result = train(cfg, stop)
    finally:
        stop.ignore_from_now()
    losses = list(result.losses.values())
    if losses:
        logging.getLogger("belief_lm").info(
            "done: %d steps, loss %.4f -> %.4f; run directory %s",
            result.steps, losses[0], losses[-1], result.run_dir,
        )  # fmt: skip
    else:
        logging.getLogger("belief_lm").info("nothing to do: already at step %d", result.steps)
    return exit_codes.DONE
