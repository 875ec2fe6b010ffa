"""The `belief-lm` command.

    belief-lm train  --config configs/tiny.yaml [--resume auto|never|DIR] [--trust-checkpoint]
                     [section.key=value ...]
    belief-lm config --config configs/tiny.yaml [--world-size N] [section.key=value ...]
        print the effective config; check it for N processes (default: launch's)
    belief-lm tokenizer train --config CONFIG --output MODEL [section.key=value ...]
    belief-lm prepare --config CONFIG --output DIR [--workers N] [section.key=value ...]
    belief-lm evaluate --checkpoint DIR [--data SOURCE] [--tensor N] [--batches N] [--output F]
    belief-lm plan --config RUN --gpus N --gpu-memory-gb M [--mfu F] [--json] [key=value ...]
        memory per GPU and step time of every layout of N GPUs, the best that fit first
    belief-lm launch local|slurm [--dry-run] --config ... [section.key=value ...]
        local: launch.tasks_per_node ranks on this machine (exits with their code: 75 passes
        through); slurm: render slurm/pretrain.sbatch and sbatch it
    belief-lm generate --checkpoint STEP_DIR --prompt TEXT [--max-new-tokens N]
                       [--temperature T (0: greedy)] [--top-k K] [--top-p P] [--seed S]
                       [--no-cache]
    belief-lm export --checkpoint STEP_DIR --format hf|torch --output PATH
    belief-lm report RUN_DIR [RUN_DIR ...] [--out PNG]
        plot a run's metrics (RUN_DIR/report.png) or overlay several (--out), and summarise
    belief-lm import-hf DIR --config RUN.yaml [section.key=value ...]
        a Hugging Face Llama folder as the run's weights-only step 0 (train starts from it)
    belief-lm checkpoint verify RUN_DIR [--sizes-only] [--workers N]
        every checkpoint intact, damaged or refused (and why); exit 0 if the newest is intact
        and not refused, else 2
    belief-lm checkpoint seal STEP_DIR
        the manifest of a checkpoint an earlier belief-lm (without checksums) saved

Exit codes (belief_lm/exit_codes.py): 0 done; 1 failed while running; 2 bad command line,
config, data or checkpoint (nothing was run; a damaged checkpoint named explicitly, or
`checkpoint verify` finding the newest one damaged); 3 the loss spiked train.spike.max_in_row
steps in a row with train.spike.action=stop (the last step was saved); 65 a data source
failed mid-run (the last completed step was saved; the message names the source, file and
row); 69 another rank was lost (a collective timed out waiting for a silent rank, named in
one line, or a peer died; nothing saved: resume from the last checkpoint); 75 stopped by
SIGTERM, SIGUSR1 or SIGINT after saving a checkpoint (requeue the job: it resumes from
there). BELIEF_LM_VERBOSE=1 shows the libraries' messages that are
otherwise kept off the console (belief_lm/logs.py).

One module here per command or command group adds its arguments to the parser, calls a
library function and prints; the work is elsewhere. `exits` is the one table from an
exception's type to the exit code above. Nothing in belief_lm imports this package.
"""

from __future__ import annotations

import argparse

from belief_lm.cli import (
    checkpoint,
    config,
    data,
    evaluate,
    export,
    generate,
    import_hf,
    launch,
    plan,
    report,
    train,
)
from belief_lm.cli.exits import run

COMMANDS = (train, config, data, evaluate, launch, plan, generate, export, report, checkpoint,
            import_hf)  # fmt: skip
"""The command modules, in the order `belief-lm --help` lists them. Each one's `add_to`
adds its commands to the parser, each with the function that runs it as `run`."""


def parser() -> argparse.ArgumentParser:
    """The command line's parser: every command's arguments."""
    parser = argparse.ArgumentParser(prog="belief-lm", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        module.add_to(commands.add_parser)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The parsed command line. argparse cannot split one positional list around options,
    so overrides are also taken from what it leaves over (`a=1 --resume never b=2`)."""
    parsed = parser()
    args, rest = parsed.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    stray = [x for x in rest if x.startswith("-") or "=" not in x or not takes_overrides]
    if stray:
        parsed.error(f"unrecognized arguments: {' '.join(stray)}")
    if not takes_overrides:
        return args
    args.overrides = [*args.overrides, *rest]
    if getattr(args, "resume", None):
        args.overrides.append(f"checkpoint.resume={args.resume}")
    if getattr(args, "trust_checkpoint", False):
        args.overrides.append("checkpoint.trust=true")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: the process's arguments) and return its exit code."""
    args = parse(argv)
    return run(args.run, args)
