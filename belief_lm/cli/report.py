"""`belief-lm report`: plot and summarise runs from their run directories (belief_lm.report);
torch-free."""

from __future__ import annotations

import argparse

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand


def add_to(add: AddCommand) -> None:
    help_text = "plot and summarise runs from their metrics (one run, or several overlaid)"
    sub = add("report", help=help_text, description=help_text)
    sub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    sub.add_argument("--out", help="the PNG to write (default RUN_DIR/report.png; needed "
                     "for several runs)")  # fmt: skip
    sub.set_defaults(run=report_runs)


def report_runs(args: argparse.Namespace) -> int:
    from belief_lm import report

    print(report.report(args.run_dirs, args.out))
    return exit_codes.DONE
