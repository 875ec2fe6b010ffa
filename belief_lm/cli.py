"""The `belief-lm` command.

    belief-lm train  --config configs/tiny.yaml [--resume auto|never|DIR] [section.key=value ...]
    belief-lm config --config configs/tiny.yaml [section.key=value ...]   (print, validate)

Exit codes: 0 done; 1 failed while running; 2 bad command line, config or checkpoint
(nothing was run); 75 stopped by SIGTERM/SIGUSR1 after saving a checkpoint (requeue the
job: it resumes from there).
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
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--config", "-c", help="run config YAML (see configs/)")
        sub.add_argument(
            "overrides",
            nargs="*",
            metavar="section.key=value",
            help="dotted overrides, applied after the file",
        )
        if name == "train":
            sub.add_argument(
                "--resume", metavar="auto|never|DIR",
                help="checkpoint to continue from (sets checkpoint.resume; default auto)",
            )  # fmt: skip
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """argparse cannot split one positional list around options, so overrides are also
    taken from what it leaves over (`a=1 --resume never b=2`)."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    stray = [x for x in rest if x.startswith("-") or "=" not in x]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = [*args.overrides, *rest]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    overrides = list(args.overrides)
    if getattr(args, "resume", None):
        overrides.append(f"checkpoint.resume={args.resume}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(cfg.to_yaml(), end="")
        return 0
    _quiet_libraries()
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
