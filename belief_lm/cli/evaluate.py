"""`belief-lm evaluate`: a checkpoint's validation loss and perplexity, as JSON on stdout."""

from __future__ import annotations

import argparse
import contextlib
import sys

from belief_lm import exit_codes, logs
from belief_lm.cli.arguments import AddCommand, add_checkpoint, quiet_libraries


def add_to(add: AddCommand) -> None:
    help_text = "validation loss and perplexity of a checkpoint (JSON), on any layout"
    sub = add("evaluate", help=help_text, description=help_text)
    add_checkpoint(sub)
    sub.add_argument("--data", help="an evaluation source (all its documents; default: the "
                     "held-out split of the checkpoint's own sources)")  # fmt: skip
    sub.add_argument("--tensor", type=int, default=1, help="tensor-parallel size")
    sub.add_argument("--batches", type=int, default=50, help="micro-batches per data-parallel rank")
    sub.add_argument("--micro-batch-size", type=int, help="default: the checkpoint's")
    sub.add_argument("--output", "-o", help="also write the JSON here")
    sub.set_defaults(run=evaluate)


def evaluate(args: argparse.Namespace) -> int:
    quiet_libraries()
    from belief_lm.evaluate import evaluate, write_report

    # stdout carries only the JSON: libraries' prints go to stderr (the known ones nowhere)
    with contextlib.redirect_stdout(logs.quieted(sys.stderr)):
        result = evaluate(
            args.checkpoint, args.data, args.tensor, args.batches, args.micro_batch_size,
            trust=args.trust_checkpoint,
        )  # fmt: skip
    text = write_report(result, args.output)  # None on ranks other than 0
    if text is not None:
        print(text)
    return exit_codes.DONE
