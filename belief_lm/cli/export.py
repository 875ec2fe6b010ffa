"""`belief-lm export`: a checkpoint as a Hugging Face transformers folder or one torch file
(belief_lm.export)."""

from __future__ import annotations

import argparse
import logging

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand, add_checkpoint, quiet_libraries
from belief_lm.export import FORMATS


def add_to(add: AddCommand) -> None:
    help_text = "export a checkpoint: a Hugging Face transformers folder or one torch file"
    sub = add("export", help=help_text, description=help_text)
    add_checkpoint(sub)
    sub.add_argument("--format", required=True, choices=FORMATS, help="hf: a folder; torch: a file")
    sub.add_argument("--output", "-o", required=True, help="path to create (must not exist)")
    sub.set_defaults(run=export_checkpoint)


def export_checkpoint(args: argparse.Namespace) -> int:
    """The output and the checkpoint are checked before the work."""
    quiet_libraries()
    from belief_lm.export import export

    output = export(args.checkpoint, args.format, args.output, args.trust_checkpoint)
    logging.getLogger("belief_lm").info("exported %s to %s", args.checkpoint, output)
    return exit_codes.DONE
