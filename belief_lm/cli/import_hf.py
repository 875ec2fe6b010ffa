"""`belief-lm import-hf`: a Hugging Face Llama folder as a run's weights-only step 0."""

from __future__ import annotations

import argparse

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand, add_config, quiet_libraries, run_config


def add_to(add: AddCommand) -> None:
    help_text = "a Hugging Face Llama checkpoint as a run's step-0 checkpoint (weights only)"
    sub = add("import-hf", help=help_text, description=help_text)
    sub.add_argument("dir", metavar="DIR", help="folder with config.json and *.safetensors")
    add_config(sub)
    sub.set_defaults(run=import_hf)


def import_hf(args: argparse.Namespace) -> int:
    cfg = run_config(args)
    quiet_libraries()
    from belief_lm.hf_import import import_hf  # heavy imports after the argument checks

    print(import_hf(args.dir, cfg))
    return exit_codes.DONE
