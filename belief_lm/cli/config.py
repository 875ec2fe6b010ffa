"""`belief-lm config`: print the effective config, checked as `train` would check it."""

from __future__ import annotations

import argparse

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand, add_config, run_config
from belief_lm.preflight import preflight


def add_to(add: AddCommand) -> None:
    help_text = "print the effective config (validates it, and checks it for a job's size)"
    sub = add("config", help=help_text, description=help_text)
    sub.add_argument(
        "--world-size", type=int, metavar="N",
        help="processes of the job to check against (default: launch.nodes x tasks per node)",
    )  # fmt: skip
    add_config(sub)
    sub.set_defaults(run=show_config)


def show_config(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    world_size = args.world_size or cfg.launch.world_size
    preflight(cfg, world_size)  # checkpoint.resume included: what `train` would meet
    print(cfg.to_yaml(), end="")
    return exit_codes.DONE
