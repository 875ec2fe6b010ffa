"""The `belief-lm` command.

    belief-lm train  --config configs/tiny.yaml [section.key=value ...]
    belief-lm config --config configs/tiny.yaml [section.key=value ...]   (print, validate)
    belief-lm tokenizer train --config CONFIG --output MODEL [section.key=value ...]
    belief-lm prepare --config CONFIG --output DIR [--workers N] [section.key=value ...]

Exit codes: 0 done, 1 failed while running, 2 bad command line or config.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from belief_lm.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belief-lm", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in (
        ("train", "pretrain a model"),
        ("config", "print the effective config (validates it)"),
    ):
        _config_arguments(commands.add_parser(name, help=help_text, description=help_text))
    tokenizer = commands.add_parser("tokenizer", help="tokenizer commands")
    tokenizer_commands = tokenizer.add_subparsers(dest="action", required=True, metavar="ACTION")
    help_text = "train a sentencepiece BPE tokenizer on a sample of data.sources"
    sub = tokenizer_commands.add_parser("train", help=help_text, description=help_text)
    sub.add_argument("--output", "-o", required=True, help="the .model file to write")
    _config_arguments(sub)
    help_text = "pre-tokenize a source into megatron-core's indexed format (.bin/.idx)"
    sub = commands.add_parser("prepare", help=help_text, description=help_text)
    sub.add_argument("--output", "-o", required=True, help="directory to write")
    sub.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizing processes")
    sub.add_argument("--source", type=int, default=0, help="index into data.sources")
    _config_arguments(sub)
    return parser


def _config_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--config", "-c", help="run config YAML (see configs/)")
    sub.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides, applied after the file",
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(cfg.to_yaml(), end="")
        return 0
    _quiet_libraries()
    if args.command in ("tokenizer", "prepare"):
        from data_pipeline import commands

        try:
            if args.command == "tokenizer":
                commands.tokenizer_train(cfg, args.output)
            else:
                commands.prepare_source(cfg, args.output, args.workers, args.source)
        except ValueError as err:  # bad data input, found before (or while) reading it
            print(f"belief-lm: {err}", file=sys.stderr)
            return 2
        return 0
    from belief_lm.train.loop import train

    try:
        result = train(cfg)
    except ValueError as err:  # configuration problems found by the pre-flight checks
        print(f"belief-lm: {err}", file=sys.stderr)
        return 2
    losses = list(result.losses.values())
    if losses:
        logging.getLogger("belief_lm").info(
            "done: %d steps, loss %.4f -> %.4f; run directory %s",
            result.steps,
            losses[0],
            losses[-1],
            result.run_dir,
        )
    return 0


def _quiet_libraries() -> None:
    """Our log lines on the first rank; library chatter and warnings only when asked for."""
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not os.environ.get("BELIEF_LM_VERBOSE"):
        warnings.filterwarnings("ignore")
        for name in ("DeepSpeed", "deepspeed", "megatron", "torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
