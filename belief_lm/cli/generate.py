"""`belief-lm generate`: continue a prompt with a trained checkpoint (belief_lm.inference)."""

from __future__ import annotations

import argparse
import logging

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand, add_checkpoint, quiet_libraries
from belief_lm.errors import BadInput


def add_to(add: AddCommand) -> None:
    help_text = "continue a prompt with a trained checkpoint (greedy, top-k or top-p sampling)"
    sub = add("generate", help=help_text, description=help_text)
    add_checkpoint(sub)
    sub.add_argument("--prompt", "-p", required=True, help="text to continue")
    sub.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens")
    sub.add_argument("--temperature", type=float, default=1.0, help="0: greedy (argmax)")
    sub.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    sub.add_argument("--top-p", type=float, help="sample among the most likely tokens up to p")
    sub.add_argument("--seed", type=int, default=0, help="same seed, same text")
    sub.add_argument(
        "--no-cache", action="store_true", help="rerun the model over the context at every step"
    )
    sub.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda if present"
    )
    sub.set_defaults(run=generate)


def generate(args: argparse.Namespace) -> int:
    """Everything is checked (the arguments, then the checkpoint) before the work."""
    quiet_libraries()
    from belief_lm.inference.generate import Sampling
    from belief_lm.inference.load import load_model

    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 0:  # before the checkpoint is loaded
        raise BadInput(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    loaded = load_model(args.checkpoint, args.device, args.trust_checkpoint)
    completion = loaded.complete(
        args.prompt, args.max_new_tokens, sampling, args.seed, use_cache=not args.no_cache
    )
    print(completion.text)
    logging.getLogger("belief_lm").info(
        "%d new tokens in %.2f s (%.1f tokens/s)%s", completion.new_tokens, completion.seconds,
        completion.new_tokens / completion.seconds,
        ", stopped at EOS" if completion.stopped_at_eos else "",
    )  # fmt: skip
    return exit_codes.DONE
