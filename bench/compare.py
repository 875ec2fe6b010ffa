"""A/B harness: attention variants trained alike, validation loss against steps and time.

    python bench/compare.py                                   # the CPU-scale comparison
    python bench/compare.py --variants softmax belief_star --seeds 1 2 3 --steps 10173 \
        --config configs/paper/gpt2-124m-owt.yaml --launcher "torchrun --nproc_per_node=8"
    python bench/compare.py --masks causal document --variants softmax attention_bn  # A/B

Every (variant, seed) is a fresh `belief-lm train` with the same config, data, steps and
evaluation schedule; seed s sets both the initial weights (run.seed) and the data order
(data.seed), so for one seed every variant starts from the same weights where shapes agree
and sees the same batches. With --masks causal document every variant also runs under each
model.attention_mask (named "<variant> (<mask>)"): the same weights and batches, and each
run's validation loss is taken under its own mask (the model's, as training evaluates).
Wall-clock is the sum of the logged step times (start-up and evaluation excluded). Writes
<out>.json (per variant: mean and std over seeds of the validation loss at every evaluated
step, mean elapsed time) and <out>.png (like the paper's Fig. 6/7: validation loss against
steps and against wall-clock).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from belief_lm.report import read_jsonl  # noqa: E402
from belief_lm.variants import VARIANTS  # noqa: E402
from bench.common import write_result  # noqa: E402


def train_command(variant: str, seed: int, args, run_dir: Path, mask: str) -> list[str]:
    """The `belief-lm train` command line of one run (`mask`: model.attention_mask)."""
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    return [
        *launcher, "-m", "belief_lm.cli", "train", "--config", args.config,
        f"model.attention={variant}", f"model.attention_mask={mask}", f"run.seed={seed}",
        f"data.seed={seed}", f"train.max_steps={args.steps}",
        f"train.eval_interval={args.eval_interval}", f"train.eval_batches={args.eval_batches}",
        f"run.output_dir={run_dir}", "run.log_interval=1", "run.tensorboard=false",
        "checkpoint.resume=never", "checkpoint.save_at_end=false", *args.overrides,
    ]  # fmt: skip


def train_one(variant: str, seed: int, args, run_dir: Path, mask: str = "causal") -> list[dict]:
    """One training run; returns its metrics.jsonl rows."""
    command = train_command(variant, seed, args, run_dir, mask)
    # a fresh job: no rendezvous variables inherited from whatever started the harness
    rendezvous = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} seed {seed} failed:\n{done.stderr[-3000:]}")
    return read_jsonl(run_dir / "metrics.jsonl")


def run_name(variant: str, mask: str, masks: list[str]) -> str:
    """A run's name in the results: the variant, and its mask when several are compared."""
    return variant if len(masks) == 1 else f"{variant} ({mask})"


def curve(rows: list[dict]) -> dict[int, tuple[float, float]]:
    """{evaluated step: (validation loss, seconds of training up to that step)}."""
    elapsed, seconds = {}, 0.0
    for row in rows:
        if "loss" in row:
            seconds += row["step_time_s"]
            elapsed[row["step"]] = seconds
    return {r["step"]: (r["val_loss"], elapsed[r["step"]]) for r in rows if "val_loss" in r}


def summarize(curves: dict[str, list[dict[int, tuple[float, float]]]]) -> dict:
    """Per variant: mean/std over seeds of the validation loss at each evaluated step and
    the mean elapsed seconds there."""
    summary = {}
    for variant, runs in curves.items():
        steps = sorted(set.intersection(*(set(run) for run in runs)))
        losses = [[run[s][0] for run in runs] for s in steps]
        summary[variant] = {
            "seeds": len(runs),
            "steps": steps,
            "val_loss_mean": [statistics.fmean(x) for x in losses],
            "val_loss_std": [statistics.stdev(x) if len(x) > 1 else 0.0 for x in losses],
            "seconds_mean": [statistics.fmean(run[s][1] for run in runs) for s in steps],
            "per_seed_final_val_loss": [run[steps[-1]][0] for run in runs],
        }
    return summary


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for variant, s in summary.items():
        mean = s["val_loss_mean"]
        low = [m - d for m, d in zip(mean, s["val_loss_std"], strict=True)]
        high = [m + d for m, d in zip(mean, s["val_loss_std"], strict=True)]
        for axis, x in ((by_step, s["steps"]), (by_time, s["seconds_mean"])):
            (line,) = axis.plot(x, mean, label=f"{variant} (n={s['seeds']})")
            axis.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training wall-clock (s)")
    by_step.set_ylabel("validation loss (mean ± std over seeds)")
    for axis in (by_step, by_time):
        axis.grid(alpha=0.3)
    by_step.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--eval-batches", type=int, default=10)
    parser.add_argument(
        "--masks", nargs="+", default=["causal"], choices=["causal", "document"],
        help="model.attention_mask of the runs: each variant under each (default causal)",
    )  # fmt: skip
    parser.add_argument("--launcher", help="prefix such as 'torchrun --nproc_per_node=8'")
    parser.add_argument("--out", default="bench/results/compare_cpu")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()

    runs = {run_name(v, m, args.masks): (v, m) for v in args.variants for m in args.masks}
    curves: dict[str, list] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as work:
        for seed in args.seeds:
            for name, (variant, mask) in runs.items():
                out = Path(work) / f"{variant}-{mask}-{seed}"
                curves[name].append(curve(train_one(variant, seed, args, out, mask)))
                final = curves[name][-1][max(curves[name][-1])]
                print(f"{name:27s} seed {seed}: val loss {final[0]:.4f} ({final[1]:.0f}s)")
    summary = summarize(curves)
    out = Path(args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = f"{os.cpu_count()} CPU cores" if device.type == "cpu" else "GPU"
    plot(summary, out.with_suffix(".png"), f"{args.config}, {args.steps} steps, {where}")
    result = {
        "benchmark": "validation loss of attention variants trained alike (bench/compare.py)",
        "config": args.config, "overrides": args.overrides, "steps": args.steps,
        "eval_interval": args.eval_interval, "eval_batches": args.eval_batches,
        "seeds": args.seeds, "masks": args.masks, "variants": summary,
        "plot": str(out.with_suffix(".png")),
    }  # fmt: skip
    print("wrote", write_result(out.with_suffix(".json"), result, device))


if __name__ == "__main__":
    main()
