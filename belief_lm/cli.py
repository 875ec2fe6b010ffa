"""The `belief-lm` command.

    belief-lm train  --config configs/tiny.yaml [section.key=value ...]
    belief-lm config --config configs/tiny.yaml [section.key=value ...]   (print, validate)
    belief-lm launch local|slurm [--dry-run] --config ... [section.key=value ...]
        local: torchrun on this machine; slurm: render slurm/pretrain.sbatch and sbatch it

Exit codes: 0 done, 1 failed while running, 2 bad command line or config.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import warnings

from belief_lm.config import ConfigError, load_config
from launcher.env import LaunchEnvError, detect


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belief-lm", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _run_arguments(commands.add_parser("train", help="pretrain a model"))
    _run_arguments(commands.add_parser("config", help="print the effective config (validates it)"))
    launch = commands.add_parser("launch", help="start training: torchrun here, or a SLURM job")
    targets = launch.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, help_text in (
        ("local", "torchrun on this machine, launch.tasks_per_node processes"),
        ("slurm", "render slurm/pretrain.sbatch from the launch section and sbatch it"),
    ):
        sub = _run_arguments(targets.add_parser(name, help=help_text))
        sub.add_argument(
            "--dry-run", action="store_true", help="print the command or script, run nothing"
        )
    return parser


def _run_arguments(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub.add_argument("--config", "-c", help="run config YAML (see configs/)")
    sub.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides, applied after the file",
    )
    return sub


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
    if args.command == "launch":
        return _launch(args, cfg)
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


def _launch(args: argparse.Namespace, cfg) -> int:
    """`launch local` execs torchrun; `launch slurm` renders the sbatch script and submits it."""
    from belief_lm.parallel.setup import check_layout
    from belief_lm.train.engine import grad_accumulation_steps
    from launcher import local, slurm

    train_args = [*(["--config", args.config] if args.config else []), *args.overrides]
    try:
        # The batch/layout checks need the world size, known here: fail now, not after
        # the job waited in the queue.
        world_size = cfg.launch.nodes * cfg.launch.tasks
        grad_accumulation_steps(
            cfg, check_layout(world_size, cfg.parallel.tensor, cfg.parallel.pipeline)
        )
        if args.target == "local":
            command = local.torchrun_command(cfg, train_args)
        else:
            script = slurm.render(cfg, train_args)
    except ValueError as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return 2
    if args.target == "local":
        if args.dry_run:
            print(shlex.join(command))
            return 0
        os.execv(command[0], command)  # torchrun takes over this process (and its signals)
    if args.dry_run:
        print(script, end="")
        return 0
    try:
        job_id, log_file = slurm.submit(cfg, script)
    except (OSError, RuntimeError) as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return 1
    print(f"submitted job {job_id}; log: {log_file}")
    return 0


def _quiet_libraries() -> None:
    """Our log lines on the first rank; library chatter and warnings only when asked for."""
    try:
        rank = detect().rank  # RANK is not set yet under SLURM or MPI
    except LaunchEnvError:
        rank = 0  # train() reports the problem
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not os.environ.get("BELIEF_LM_VERBOSE"):
        warnings.filterwarnings("ignore")
        for name in ("DeepSpeed", "deepspeed", "megatron", "torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
