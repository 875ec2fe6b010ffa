"""`belief-lm checkpoint verify|seal`: a run's checkpoints intact, damaged or refused, and
the manifest of one saved without checksums (belief_lm.checkpoint.verify); torch only for
verify's check of the files' pickles (belief_lm.checkpoint.loading.refusals)."""

from __future__ import annotations

import argparse

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand, quiet_libraries


def add_to(add: AddCommand) -> None:
    checkpoint = add("checkpoint", help="checkpoint commands")
    actions = checkpoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    help_text = (
        "list every checkpoint of a run as intact, damaged or refused (and why); exit 0 if the "
        "newest is intact, 2 if it is damaged, refused or there is none"
    )
    sub = actions.add_parser("verify", help=help_text, description=help_text)
    sub.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its checkpoints/)")
    sub.add_argument(
        "--sizes-only", action="store_true",
        help="compare sizes only (instant), not checksums (reads every file once)",
    )  # fmt: skip
    sub.add_argument("--workers", type=int, default=4, help="files checksummed at a time")
    sub.set_defaults(run=verify)
    help_text = (
        "write the manifest of a checkpoint saved by a belief-lm without checksums, "
        "trusting its files as they are now (a resume refuses a checkpoint without one)"
    )
    sub = actions.add_parser("seal", help=help_text, description=help_text)
    sub.add_argument("checkpoint", metavar="STEP_DIR", help="a checkpoint step directory")
    sub.set_defaults(run=seal)


def verify(args: argparse.Namespace) -> int:
    """Every checkpoint of the run, intact, damaged or refused; exit code 2 if the newest is
    damaged or refused (or there is none)."""
    from belief_lm.checkpoint.verify import check_run, report

    checksums = not args.sizes_only
    if checksums:
        quiet_libraries()  # the pickles' check imports torch and DeepSpeed
    check = check_run(args.run_dir, checksums, args.workers)
    print(report(check, checksums))
    return exit_codes.DONE if check.newest_loadable else exit_codes.BAD_INPUT


def seal(args: argparse.Namespace) -> int:
    from belief_lm.checkpoint.verify import seal_legacy

    print(seal_legacy(args.checkpoint))
    return exit_codes.DONE
