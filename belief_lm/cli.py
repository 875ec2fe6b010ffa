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

This module parses, calls a library function and prints; the work is elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from belief_lm import exit_codes, logs
from belief_lm.config import Config, ConfigError, load_config
from belief_lm.export import FORMATS
from belief_lm.parallel.env import LaunchEnvError, detect, free_port
from belief_lm.preflight import preflight


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belief-lm", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser("train", help="pretrain a model", description="pretrain a model")
    train.add_argument(
        "--resume", metavar="auto|never|DIR",
        help="checkpoint to continue from (sets checkpoint.resume; default auto)",
    )  # fmt: skip
    _trust_argument(train)
    _config_arguments(train)
    help_text = "print the effective config (validates it, and checks it for a job's size)"
    sub = commands.add_parser("config", help=help_text, description=help_text)
    sub.add_argument(
        "--world-size", type=int, metavar="N",
        help="processes of the job to check against (default: launch.nodes x tasks per node)",
    )  # fmt: skip
    _config_arguments(sub)
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
    help_text = "validation loss and perplexity of a checkpoint (JSON), on any layout"
    sub = commands.add_parser("evaluate", help=help_text, description=help_text)
    _checkpoint_argument(sub)
    sub.add_argument("--data", help="an evaluation source (all its documents; default: the "
                     "held-out split of the checkpoint's own sources)")  # fmt: skip
    sub.add_argument("--tensor", type=int, default=1, help="tensor-parallel size")
    sub.add_argument("--batches", type=int, default=50, help="micro-batches per data-parallel rank")
    sub.add_argument("--micro-batch-size", type=int, help="default: the checkpoint's")
    sub.add_argument("--output", "-o", help="also write the JSON here")
    launch = commands.add_parser("launch", help="start training: ranks here, or a SLURM job")
    targets = launch.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, help_text in (
        ("local", "launch.tasks_per_node ranks on this machine, watched by this process"),
        ("slurm", "render slurm/pretrain.sbatch from the launch section and sbatch it"),
    ):
        sub = targets.add_parser(name, help=help_text, description=help_text)
        sub.add_argument(
            "--dry-run", action="store_true", help="print the command or script, run nothing"
        )
        _config_arguments(sub)
    _plan_arguments(commands)
    _generate_arguments(commands)
    help_text = "export a checkpoint: a Hugging Face transformers folder or one torch file"
    sub = commands.add_parser("export", help=help_text, description=help_text)
    _checkpoint_argument(sub)
    sub.add_argument("--format", required=True, choices=FORMATS, help="hf: a folder; torch: a file")
    sub.add_argument("--output", "-o", required=True, help="path to create (must not exist)")
    help_text = "plot and summarise runs from their metrics (one run, or several overlaid)"
    sub = commands.add_parser("report", help=help_text, description=help_text)
    sub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    sub.add_argument("--out", help="the PNG to write (default RUN_DIR/report.png; needed "
                     "for several runs)")  # fmt: skip
    _checkpoint_commands(commands)
    help_text = "a Hugging Face Llama checkpoint as a run's step-0 checkpoint (weights only)"
    sub = commands.add_parser("import-hf", help=help_text, description=help_text)
    sub.add_argument("dir", metavar="DIR", help="folder with config.json and *.safetensors")
    _config_arguments(sub)
    return parser


def _checkpoint_commands(commands) -> None:
    checkpoint = commands.add_parser("checkpoint", help="checkpoint commands")
    actions = checkpoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    help_text = (
        "list every checkpoint of a run as intact, damaged or refused (and why); exit 0 if the "
        "newest is intact, 2 if it is damaged, refused or there is none"
    )
    sub = actions.add_parser("verify", help=help_text, description=help_text)
    sub.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its checkpoints/)")
    sub.add_argument(
        "--sizes-only", action="store_true",
        help="compare sizes only (instant), not checksums (reads every file once)",
    )  # fmt: skip
    sub.add_argument("--workers", type=int, default=4, help="files checksummed at a time")
    help_text = (
        "write the manifest of a checkpoint saved by a belief-lm without checksums, "
        "trusting its files as they are now (a resume refuses a checkpoint without one)"
    )
    sub = actions.add_parser("seal", help=help_text, description=help_text)
    sub.add_argument("checkpoint", metavar="STEP_DIR", help="a checkpoint step directory")


def _plan_arguments(commands) -> None:
    help_text = "predict memory per GPU and step time of every layout of N GPUs; rank them"
    sub = commands.add_parser("plan", help=help_text, description=help_text)
    sub.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    sub.add_argument("--gpu-memory-gb", type=float, required=True, help="memory of one GPU")
    sub.add_argument("--gpus-per-node", type=int, help="default: launch.gpus_per_node, or 8")
    sub.add_argument("--mfu", type=float, default=0.4, help="fraction of peak FLOP/s reached")
    sub.add_argument(
        "--peak-tflops", type=float, help="peak TFLOP/s of a GPU (default: run.peak_tflops, "
        "or an H100's 989 bf16)",
    )  # fmt: skip
    sub.add_argument("--bandwidth-gbs", type=float, default=300.0, help="within a node, GB/s")
    sub.add_argument(
        "--inter-node-bandwidth-gbs", type=float, default=40.0, help="between nodes, per GPU"
    )
    sub.add_argument(
        "--reserve-gb", type=float, default=2.0,
        help="memory a GPU needs beyond the allocator's peak (CUDA context, NCCL, fragmentation)",
    )  # fmt: skip
    sub.add_argument("--max-micro-batch", type=int, default=64, help="largest micro-batch tried")
    sub.add_argument("--top", type=int, default=10, help="layouts shown (0: all, with --json)")
    sub.add_argument("--json", action="store_true", help="JSON instead of the table")
    _config_arguments(sub)


def _generate_arguments(commands) -> None:
    help_text = "continue a prompt with a trained checkpoint (greedy, top-k or top-p sampling)"
    sub = commands.add_parser("generate", help=help_text, description=help_text)
    _checkpoint_argument(sub)
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


def _checkpoint_argument(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--checkpoint", required=True, metavar="DIR",
        help="a checkpoint step directory, e.g. runs/tiny/checkpoints/step_000300, or a run "
        "directory (runs/tiny): its newest intact checkpoint",
    )  # fmt: skip
    _trust_argument(sub)


def _trust_argument(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--trust-checkpoint", action="store_true",
        help="load checkpoint files holding more than a checkpoint may (an earlier belief-lm's) "
        "with pickle, which can run code: only for checkpoints you made yourself (train: sets "
        "checkpoint.trust)",
    )  # fmt: skip


def _config_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--config", "-c", help="run config YAML (see configs/)")
    sub.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides, applied after the file",
    )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """argparse cannot split one positional list around options, so overrides are also
    taken from what it leaves over (`a=1 --resume never b=2`)."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    stray = [x for x in rest if x.startswith("-") or "=" not in x or not takes_overrides]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if not takes_overrides:
        return args
    args.overrides = [*args.overrides, *rest]
    if getattr(args, "resume", None):
        args.overrides.append(f"checkpoint.resume={args.resume}")
    if getattr(args, "trust_checkpoint", False):
        args.overrides.append("checkpoint.trust=true")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command == "evaluate":
        return _evaluate(args)
    if args.command in ("generate", "export"):
        return _from_checkpoint(args)
    if args.command == "report":
        return _report(args)
    if args.command == "checkpoint":
        return _verify_checkpoints(args)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":
            world_size = args.world_size or cfg.launch.world_size
            preflight(cfg, world_size)  # checkpoint.resume included: what `train` would meet
            print(cfg.to_yaml(), end="")
            return exit_codes.DONE
        if args.command == "plan":
            return _plan(args, cfg)
        _quiet_libraries()
        if args.command == "launch":
            return _launch(args, cfg)
        if args.command == "train":
            return _train(cfg)
        if args.command == "import-hf":
            from belief_lm.hf_import import import_hf  # heavy imports after the argument checks

            print(import_hf(args.dir, cfg))
            return exit_codes.DONE
        from belief_lm import data_commands  # heavy imports after the argument checks

        if args.command == "tokenizer":
            data_commands.tokenizer_train(cfg, args.output)
        else:
            data_commands.prepare_source(cfg, args.output, args.workers, args.source)
        return exit_codes.DONE
    except (ConfigError, ValueError) as err:  # bad config, data or checkpoint: before work
        return bad_input_exit(err)


PACKAGES = ("belief_lm", "data_pipeline", "launcher")
"""The project's packages (installed side by side)."""


def bad_input_exit(err: ValueError) -> int:
    """Exit code 2 with one line for a ValueError belief-lm raised itself: its checks of
    the command line, config, data and checkpoints, which come before any work. A
    ValueError raised inside torch, DeepSpeed or another library is a failure, not bad
    input: it goes on (a traceback, exit code 1)."""
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    origin = Path(frame.tb_frame.f_code.co_filename).resolve() if frame else None
    if origin is None or not any(origin.is_relative_to(p) for p in _OUR_PACKAGES):
        raise err
    print(f"belief-lm: {err}", file=sys.stderr)
    return exit_codes.BAD_INPUT


_OUR_PACKAGES = [Path(__file__).resolve().parents[1] / p for p in PACKAGES]


def _plan(args: argparse.Namespace, cfg: Config) -> int:
    """`plan`: every layout of --gpus scored by belief_lm.plan; a table, or JSON."""
    from belief_lm import plan

    machine = plan.Machine(
        gpus=args.gpus,
        memory_gb=args.gpu_memory_gb,
        gpus_per_node=args.gpus_per_node or cfg.launch.gpus_per_node or 8,
        peak_tflops=args.peak_tflops or cfg.run.peak_tflops or plan.Machine.peak_tflops,
        mfu=args.mfu,
        bandwidth_gbs=args.bandwidth_gbs,
        inter_node_bandwidth_gbs=args.inter_node_bandwidth_gbs,
        reserve_gb=args.reserve_gb,
    )
    vocab_size = plan.run_vocab_size(cfg)
    estimates = plan.plan(cfg, machine, vocab_size, args.max_micro_batch)
    if not estimates:
        raise ValueError(f"no layout of {args.gpus} GPUs passes pre-flight for this config")
    fitting = sum(e.fits for e in estimates)
    if args.json:
        shown = estimates[: args.top] if args.top else estimates
        report = {
            "machine": dataclasses.asdict(machine), "model": cfg.model.name,
            "attention": cfg.model.attention, "vocab_size": vocab_size,
            "tokens_per_step": cfg.train.global_batch_size * cfg.model.seq_length,
            "layouts": len(estimates), "fitting": fitting,
            "estimates": [e.as_dict() for e in shown],
        }  # fmt: skip
        print(json.dumps(report, indent=1))
        return exit_codes.DONE
    print(
        f"{cfg.model.name} ({cfg.model.attention}), vocab {vocab_size:,}, "
        f"{cfg.train.global_batch_size} x {cfg.model.seq_length} tokens per step on "
        f"{machine.gpus} GPUs of {machine.memory_gb:g} GB ({machine.reserve_gb:g} GB reserved), "
        f"{machine.gpus_per_node} per node; {machine.peak_tflops:g} TFLOP/s at MFU "
        f"{machine.mfu:g}, {machine.bandwidth_gbs:g} / {machine.inter_node_bandwidth_gbs:g} "
        f"GB/s within / between nodes"
    )
    print(plan.table(estimates, args.top or len(estimates)))
    print(f"{fitting} of {len(estimates)} layouts fit")
    return exit_codes.DONE if fitting else exit_codes.FAILED


def _from_checkpoint(args: argparse.Namespace) -> int:
    """generate / export: everything is checked (arguments, then the checkpoint) before the
    work, and a problem found there exits with 2."""
    _quiet_libraries()
    try:
        if args.command == "export":
            from belief_lm.export import export

            output = export(args.checkpoint, args.format, args.output, args.trust_checkpoint)
            logging.getLogger("belief_lm").info("exported %s to %s", args.checkpoint, output)
            return exit_codes.DONE
        from belief_lm.inference.generate import Sampling
        from belief_lm.inference.load import load_model

        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        if args.max_new_tokens < 0:  # before the checkpoint is loaded
            raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
        loaded = load_model(args.checkpoint, args.device, args.trust_checkpoint)
        completion = loaded.complete(
            args.prompt, args.max_new_tokens, sampling, args.seed, use_cache=not args.no_cache
        )
    except ValueError as err:
        return bad_input_exit(err)
    print(completion.text)
    logging.getLogger("belief_lm").info(
        "%d new tokens in %.2f s (%.1f tokens/s)%s", completion.new_tokens, completion.seconds,
        completion.new_tokens / completion.seconds,
        ", stopped at EOS" if completion.stopped_at_eos else "",
    )  # fmt: skip
    return exit_codes.DONE


def _train(cfg: Config) -> int:
    from belief_lm.train.signals import Preempted, StopRequests

    # caught from the first moment (before the heavy imports), then ignored until the process
    # ends: no signal during start-up or after the save may kill the rank
    stop = StopRequests().catch()
    from belief_lm.parallel.peers import PeerLost
    from belief_lm.train.loop import DataStop, NonFiniteLossError, SpikeStop, train

    try:
        result = train(cfg, stop)
    except PeerLost as lost:  # one line from the rank that knows (or none), no traceback
        if lost.line is not None:
            print(lost.line, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # not a normal exit: the process group's destructor would join a worker thread that
        # may still wait on the silent rank (an abandoned asynchronous wait)
        os._exit(exit_codes.PEER_LOST)
    except Preempted as stopped:
        logging.getLogger("belief_lm").warning("%s; exiting with %d", stopped, exit_codes.PREEMPTED)
        return exit_codes.PREEMPTED
    except NonFiniteLossError as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return exit_codes.FAILED
    except DataStop as err:
        print(f"belief-lm: data fault: {err}", file=sys.stderr)
        return exit_codes.DATA_FAULT
    except SpikeStop as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return exit_codes.LOSS_SPIKES
    finally:
        stop.ignore_from_now()
    losses = list(result.losses.values())
    if losses:
        logging.getLogger("belief_lm").info(
            "done: %d steps, loss %.4f -> %.4f; run directory %s",
            result.steps, losses[0], losses[-1], result.run_dir,
        )  # fmt: skip
    else:
        logging.getLogger("belief_lm").info("nothing to do: already at step %d", result.steps)
    return exit_codes.DONE


def _report(args: argparse.Namespace) -> int:
    """`report`: torch-free (it reads the run directories' JSON lines)."""
    from belief_lm import report

    try:
        print(report.report(args.run_dirs, args.out))
    except ValueError as err:  # a missing run directory, no metrics, no matplotlib
        return bad_input_exit(err)
    return exit_codes.DONE


def _verify_checkpoints(args: argparse.Namespace) -> int:
    """`checkpoint verify` and `checkpoint seal`: manifests and checksums (torch only for
    verify's check of the files' pickles, loading.refusals)."""
    from belief_lm.checkpoint.verify import check_run, report, seal_legacy

    if args.action == "seal":
        try:
            print(seal_legacy(args.checkpoint))
        except ValueError as err:  # no such checkpoint, incomplete, or sealed already
            return bad_input_exit(err)
        return exit_codes.DONE
    checksums = not args.sizes_only
    if checksums:
        _quiet_libraries()  # the pickles' check imports torch and DeepSpeed
    check = check_run(args.run_dir, checksums, args.workers)
    print(report(check, checksums))
    return exit_codes.DONE if check.newest_loadable else exit_codes.BAD_INPUT


def _evaluate(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from belief_lm.evaluate import evaluate, write_report

    try:
        # stdout carries only the JSON: libraries' prints go to stderr (the known ones nowhere)
        with contextlib.redirect_stdout(logs.quieted(sys.stderr)):
            result = evaluate(
                args.checkpoint, args.data, args.tensor, args.batches, args.micro_batch_size,
                trust=args.trust_checkpoint,
            )  # fmt: skip
    except ValueError as err:  # a missing or unusable checkpoint or data source
        return bad_input_exit(err)
    text = write_report(result, args.output)  # None on ranks other than 0
    if text is not None:
        print(text)
    return exit_codes.DONE


def _launch(args: argparse.Namespace, cfg: Config) -> int:
    """`launch local` starts and watches the ranks; `launch slurm` renders the sbatch script
    and submits it. Pre-flight runs here for the job's world size: a config `train` would
    refuse fails now, not after the job waited in the queue."""
    from launcher import local, slurm

    device_type = "cuda" if cfg.launch.gpus_per_node else "cpu"
    for world_size in cfg.launch.world_sizes:  # every allocation the job may get
        preflight(cfg, world_size, device_type)  # ValueError: main() exits 2
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
    try:
        job_id, log_file = slurm.submit(cfg, script)
    except (OSError, RuntimeError) as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return exit_codes.FAILED
    print(f"submitted job {job_id}; log: {log_file}")
    return exit_codes.DONE


def _quiet_libraries() -> None:
    """Our log lines on the first rank; the libraries' known chatter off the console."""
    try:
        rank = detect().rank  # RANK is not set yet under SLURM or MPI
    except LaunchEnvError:
        rank = 0  # train() reports the problem
    logs.configure(rank)


if __name__ == "__main__":
    sys.exit(main())
