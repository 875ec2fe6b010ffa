"""A cooldown ladder from one run per variant: a constant-rate (WSD stable phase) run on the
embedded corpus, then a linear cooldown branch (`checkpoint.branch`) from each of several
stable-phase checkpoints; the validation loss at each cooldown's end against its tokens.
The cheap way to compare variants at matched token counts (OLMo-core's model ladder).

    .venv/bin/python -m bench.cooldowns --variants softmax belief_star --points 4 8 12 \\
        --cooldown 4

Runs in this process, one after the other, under --root (default runs/cooldowns). On a GPU
the same command runs a paper config (--config, overrides after --).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from belief_lm.config import load_config
from belief_lm.train.loop import train
from bench.common import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/test/micro.yaml")
    parser.add_argument("--variants", nargs="+", default=["softmax", "belief_star"])
    parser.add_argument("--points", nargs="+", type=int, default=[4, 8, 12],
                        help="stable-phase steps the cooldowns branch from")  # fmt: skip
    parser.add_argument("--cooldown", type=int, default=4, help="steps of each linear decay")
    parser.add_argument("--root", default="runs/cooldowns")
    parser.add_argument("--output", default="bench/results/cooldowns_cpu.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    ladder = run_ladder(
        args.config, args.variants, args.points, args.cooldown, Path(args.root), args.overrides
    )
    output = Path(args.output)
    write_result(output, {"config": args.config, "overrides": args.overrides,
                          "cooldown_steps": args.cooldown, "ladder": ladder,
                          "note": "shared 2-core machine"}, torch.device("cpu"))  # fmt: skip
    plot(ladder, output.with_suffix(".png"))


def run_ladder(
    config: str,
    variants: list[str],
    points: list[int],
    cooldown: int,
    root: Path,
    overrides: list[str],
) -> dict[str, list[dict]]:
    """Per variant, a constant-rate run to the last of `points` under `root/<variant>/stable`
    (a checkpoint at each point), then from each point a `cooldown`-step linear decay to
    train.min_lr (`root/<variant>/cool<point>`); each cooldown's end as {branch_step, steps,
    tokens, val_loss, train_loss}. `overrides` apply to every run (after the ladder's
    evaluation settings, which they may change)."""
    last = max(points)
    # a checkpoint at every branch point and no others (a paper config's are large)
    interval = math.gcd(*points)
    common = ["train.eval_interval=1000000", "train.eval_batches=4", *overrides]
    ladder: dict[str, list[dict]] = {}
    for variant in variants:
        stable = root / variant / "stable"
        train(
            load_config(
                config,
                [
                    *common,
                    f"model.attention={variant}",
                    f"run.output_dir={stable}",
                    "train.lr_schedule=constant",
                    f"train.max_steps={last}",
                    f"train.decay_steps={last}",
                    f"checkpoint.interval={interval}",
                    f"checkpoint.keep={last // interval}",
                ],
            )
        )
        ladder[variant] = []
        for point in points:
            end = point + cooldown
            cfg = load_config(config, [
                *common, f"model.attention={variant}",
                f"run.output_dir={root / variant / f'cool{point}'}",
                f"checkpoint.branch={stable / 'checkpoints' / f'step_{point:06d}'}",
                "train.lr_schedule=wsd", f"train.max_steps={end}", f"train.decay_steps={end}",
                f"train.wsd_decay_steps={cooldown}", "train.wsd_decay_shape=linear",
                "checkpoint.save_at_end=false",
            ])  # fmt: skip
            result = train(cfg)
            tokens = end * cfg.train.global_batch_size * cfg.model.seq_length
            ladder[variant].append(
                {"branch_step": point, "steps": end, "tokens": tokens,
                 "val_loss": result.val_losses[end], "train_loss": result.losses.get(end)}
            )  # fmt: skip
            print(json.dumps({"variant": variant, **ladder[variant][-1]}))
    return ladder


def plot(ladder: dict[str, list[dict]], path: Path) -> None:
    """Final validation loss against tokens, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for variant, points in ladder.items():
        axes.plot([p["tokens"] for p in points], [p["val_loss"] for p in points], "o-",
                  label=variant)  # fmt: skip
    axes.set_xlabel("tokens at the cooldown's end")
    axes.set_ylabel("validation loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
