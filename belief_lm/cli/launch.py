"""`belief-lm launch local|slurm`: start training, the ranks of this machine (launcher.local)
or a SLURM job (launcher.slurm)."""

from __future__ import annotations

import argparse
import shlex

from belief_lm import exit_codes
from belief_lm.cli.arguments import (
    AddCommand,
    add_branch,
    add_config,
    quiet_libraries,
    run_config,
)
from belief_lm.parallel.env import free_port
from belief_lm.preflight import preflight


def add_to(add: AddCommand) -> None:
    launch = add("launch", help="start training: ranks here, or a SLURM job")
    targets = launch.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, help_text in (
        ("local", "launch.tasks_per_node ranks on this machine, watched by this process"),
        ("slurm", "render slurm/pretrain.sbatch from the launch section and sbatch it"),
    ):
        sub = targets.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "--dry-run", action="store_true", help="print the command or script, run nothing"
        )
        add_branch(sub)
        add_config(sub)
        sub.set_defaults(run=launch_job)


def launch_job(args: argparse.Namespace) -> int:
    """`launch local` starts and watches the ranks; `launch slurm` renders the sbatch script
    and submits it. Pre-flight runs here for the job's world size: a config `train` would
    refuse fails now, not after the job waited in the queue."""
    cfg = run_config(args)
    quiet_libraries()
    from launcher import local, slurm

    device_type = "cuda" if cfg.launch.gpus_per_node else "cpu"
    for world_size in cfg.launch.world_sizes:  # every allocation the job may get
        preflight(cfg, world_size, device_type)
    train_args = [*(["--config", args.config] if args.config else []), *args.overrides]
    if args.target == "local":
        port = free_port()
        if args.dry_run:
            for env, command in local.rank_commands(cfg, train_args, port):
                print(shlex.join([f"{k}={v}" for k, v in env.items()] + command))
            return exit_codes.DONE
        return local.run(cfg, train_args, free_port)  # the ranks' code (75 passes through)
    script = slurm.render(cfg, train_args)
    if args.dry_run:
        print(script, end="")
        return exit_codes.DONE
    job_id, log_file = slurm.submit(cfg, script)
    print(f"submitted job {job_id}; log: {log_file}")
    return exit_codes.DONE
