"""Training step time of belief / belief_star relative to softmax at the same layout.

    python bench/parallel_step_time.py                    # CPU: TP=1 and TP=2, gloo
    python bench/parallel_step_time.py --tp 1 2 4 --device cuda --model configs/model/gpt2-124m.yaml

Runs the real `belief-lm train` under torchrun for each (layout, variant) and takes the
median step time over the logged steps after warm-up; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from belief_lm.report import read_jsonl  # noqa: E402
from bench.common import write_result  # noqa: E402

VARIANTS = ["softmax", "belief", "belief_star"]
CPU_MODEL = [
    "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=8",
    "model.num_query_groups=4", "model.ffn_hidden_size=768", "model.seq_length=256",
    "train.micro_batch_size=8", "train.global_batch_size=8",
]  # fmt: skip


def run(tp: int, variant: str, args, overrides: list[str]) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={tp}", "-m", "belief_lm.cli", "train", "--config", args.model,
            f"model.attention={variant}", f"parallel.tensor={tp}", f"run.device={args.device}",
            f"train.max_steps={args.steps}", "run.log_interval=1", "run.tensorboard=false",
            f"run.output_dir={out}", "checkpoint.save_at_end=false", "checkpoint.resume=never",
            *overrides,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // tp))}
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=3600)
        rows = read_jsonl(Path(out, "metrics.jsonl"))
    steps = [r for r in rows if "loss" in r]  # not the validation rows a config may add
    return [r["step_time_s"] for r in steps[args.warmup :]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="configs/tiny.yaml")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every configuration")
    parser.add_argument("--warmup", type=int, default=5, help="logged steps to ignore")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides (default: a CPU size)")
    args = parser.parse_args()
    overrides = args.overrides or (CPU_MODEL if args.device == "cpu" else [])

    # Layouts and variants take turns, round after round, so that a slow spell of the
    # machine hits all of them alike; each number is the median over all its steps.
    times = {(tp, v): [] for tp in args.tp for v in VARIANTS}
    for _ in range(args.rounds):
        for tp, variant in times:
            times[(tp, variant)] += run(tp, variant, args, overrides)
    layouts = {}
    for tp in args.tp:
        rows = {}
        for variant in VARIANTS:
            samples = times[(tp, variant)]
            rows[variant] = {
                "median_step_s": statistics.median(samples), "steps": len(samples),
                "min_step_s": min(samples), "max_step_s": max(samples),
            }  # fmt: skip
            print(f"TP={tp} {variant:12s} {rows[variant]['median_step_s'] * 1e3:8.1f} ms")
        base = rows["softmax"]["median_step_s"]
        for row in rows.values():
            row["relative_to_softmax"] = row["median_step_s"] / base
        layouts[f"tp{tp}"] = rows
    out = args.out or f"bench/results/parallel_step_time_{args.device}.json"
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    result = {
        "benchmark": "median training step time (belief-lm train under torchrun) per variant",
        "config": args.model, "overrides": overrides, "steps": args.steps,
        "warmup_logged_steps": args.warmup, "rounds": args.rounds, "layouts": layouts,
    }  # fmt: skip
    print("wrote", write_result(out, result, device))


if __name__ == "__main__":
    main()
