"""`belief-lm plan`: memory per GPU and step time of every layout of N GPUs (belief_lm.plan),
the best that fit first; torch-free."""

from __future__ import annotations

import argparse
import dataclasses
import json

from belief_lm import exit_codes
from belief_lm.cli.arguments import AddCommand, add_config, run_config
from belief_lm.errors import BadInput


def add_to(add: AddCommand) -> None:
    help_text = "predict memory per GPU and step time of every layout of N GPUs; rank them"
    sub = add("plan", help=help_text, description=help_text)
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
    sub.add_argument(
        "--both-sequence-parallel", action="store_true",
        help="rank every layout of TP > 1 with sequence parallelism on and off (default: as "
        "parallel.sequence_parallel has it: on whenever TP > 1)",
    )  # fmt: skip
    sub.add_argument("--top", type=int, default=10, help="layouts shown (0: all, with --json)")
    sub.add_argument("--json", action="store_true", help="JSON instead of the table")
    add_config(sub)
    sub.set_defaults(run=plan_layouts)


def plan_layouts(args: argparse.Namespace) -> int:
    """Every layout of --gpus scored by belief_lm.plan: a table, or JSON; exit code 1 if
    none fits."""
    cfg = run_config(args)
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
    estimates = plan.plan(
        cfg, machine, vocab_size, args.max_micro_batch,
        both_sequence_parallel=args.both_sequence_parallel,
    )  # fmt: skip
    if not estimates:
        raise BadInput(f"no layout of {args.gpus} GPUs passes pre-flight for this config")
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
