"""Streamed training against the same documents pre-tokenized and shuffled (`prepare`).

    python bench/stream_vs_prepared.py    # -> bench/results/stream_vs_prepared_cpu.{json,png}

For each corpus, `configs/tiny.yaml` (16 sequences of 128 tokens a step, lr 3e-3 -> 3e-4
cosine, 30 warmup steps) trained for --steps steps (2+ epochs) from the same seed and
tokenizer on the same training documents (the id-hash split holds out the same ones), in
each of these orders:
  streamed      the streaming pipeline as configured (data.open_documents=8: each reader
                draws every window from one of 8 open documents);
  one document  data.open_documents=1: each reader's windows one document after another
                (the order before data.open_documents);
  24 open       data.open_documents=24: a document's windows spread over 3 times as many
                steps;
  prepared      `belief-lm prepare`, then data.sources=[prepared:DIR]: megatron-core's
                GPTDataset, samples shuffled globally.
Corpora:
  embedded      README command 1's (2,361 documents of Python's documentation, most shorter
                than a window: 227 steps an epoch);
  long          250 FineWeb-Edu-schema documents, stretches of the same prose (1.7 M
                characters; the last 8% of the rows' text wraps to its start), lognormal
                in length around 4,500 characters (median about 9 windows of 128 tokens,
                a tenth over 30, the longest over 100).
Every order runs at each of --seeds (data.seed: the streams' draw, or the prepared samples'
shuffle; the model's initial weights stay the same): one prepared run's final validation
loss moved by 0.06 from one seed to another, more than the 0.02 to be judged, so orders are
compared by their mean over seeds (and its spread). A checkpoint is saved every
--eval-interval steps, and every checkpoint of every run is evaluated here on the same
held-out windows (the validation split's documents written as
one JSON lines file, read as `belief-lm evaluate --data FILE` reads it). Reported per
corpus and order: the validation loss at every evaluation, the epoch turns, the largest
rise of the validation loss within --turn-window steps after a turn, the mean
data/documents_per_step, the training seconds (each per seed, and over the seeds); and per
corpus the gap of the means, streamed - prepared, at every evaluation after warmup, with its
standard error (target: at most 0.02 nats).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "data_pipeline"))

import torch  # noqa: E402

from belief_lm.report import read_jsonl  # noqa: E402
from bench.common import write_result  # noqa: E402

CONFIG = "configs/tiny.yaml"
WARMUP = 30
"""configs/tiny.yaml's train.warmup_steps: the gap is judged after it."""
ORDERS = {
    "streamed": [],
    "one document": ["data.open_documents=1"],
    "24 open": ["data.open_documents=24"],
    "prepared": None,  # data.sources=[prepared:DIR]
}
LONG = {"documents": 250, "median_chars": 4500}
SEEDS = [1234, 7, 11]
"""data.seed of each order's runs (1234: the config's): one seed's prepared run moved the
final validation loss by 0.06 against another's, more than the gap to be judged."""
THREADS = 1
"""Torch threads of each command (OMP_NUM_THREADS; --threads): runs side by side share the
machine's cores without oversubscribing them."""


def corpus_overrides(name: str, work: Path, tokenizer: Path, args) -> list[str]:
    """The data overrides of a corpus (writing its files first)."""
    if name == "embedded":
        held_out = args.embedded_validation_fraction
        return [f"data.validation_fraction={held_out}", f"data.tokenizer.path={tokenizer}"]
    from corpora import long_document_rows, write_parquet

    rows = long_document_rows(args.long_documents, LONG["median_chars"])
    for f in range(4):
        write_parquet(work / "long" / f"{f:03d}.parquet", rows[f::4], 16)
    return [
        f"data.sources=[{{uri: '{work}/long/*.parquet', id_column: id}}]",
        "data.validation_fraction=0.1",
        f"data.tokenizer.path={tokenizer}",
    ]


def held_out(overrides: list[str], path: Path) -> Path:
    """The corpus's validation documents as one JSON lines file (every run is evaluated on
    them, cut into the same windows)."""
    from belief_lm.config import load_config
    from data_pipeline.build import open_source
    from data_pipeline.stream import DocumentReader, StreamSettings

    data = load_config(str(ROOT / CONFIG), overrides).data
    settings = StreamSettings(window=2, split="validation",
                              validation_fraction=data.validation_fraction)  # fmt: skip
    source = open_source(data.sources[0])
    reader = DocumentReader(source, settings)
    with open(path, "w") as out:
        for doc, *_ in reader.documents(source.units()):
            out.write(json.dumps({"text": doc.text}) + "\n")
    return path


def cli(*args: str) -> None:
    """A `belief-lm` command in a fresh process (no rendezvous variables inherited)."""
    rendezvous = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    command = [sys.executable, "-m", "belief_lm.cli", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:1])} failed:\n{done.stderr[-3000:]}")


def train(run_dir: Path, overrides: list[str], args) -> float | None:
    """One training run, a checkpoint every eval_interval steps; its wall seconds (None: a
    finished run kept in --work, not trained again)."""
    if args.work and (run_dir / "checkpoints" / f"step_{args.steps:06d}").is_dir():
        return None
    started = time.perf_counter()
    cli(
        "train", "--config", CONFIG, f"run.output_dir={run_dir}",
        f"train.max_steps={args.steps}", "train.eval_interval=0", "run.log_interval=1",
        "run.tensorboard=false", "checkpoint.resume=never",
        f"checkpoint.interval={args.eval_interval}", "checkpoint.keep=1000", *overrides,
    )  # fmt: skip
    return time.perf_counter() - started


def curve(run_dir: Path, heldout: Path, batches: int) -> dict:
    """Validation loss of every checkpoint of a run on `heldout`, and what its metrics say
    (kept in the run directory: a run kept in --work is not evaluated again)."""
    from belief_lm.evaluate import evaluate

    kept = run_dir / f"heldout_curve_{batches}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    steps, losses = [], []
    for checkpoint in sorted((run_dir / "checkpoints").glob("step_*")):
        result = evaluate(str(checkpoint), data_source=str(heldout), max_batches=batches)
        steps.append(result["step"])
        losses.append(round(result["loss"], 4))
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    epochs = [(r["step"], r.get("data/0/epoch", 0)) for r in rows]
    turns = [step for (step, e), (_, before) in zip(epochs[1:], epochs, strict=False) if e > before]
    documents = [r["data/documents_per_step"] for r in rows if "data/documents_per_step" in r]
    measured = {
        "steps": steps,
        "val_loss": losses,
        "epoch_turns": turns,
        "train_loss_last_10": round(sum(r["loss"] for r in rows[-10:]) / len(rows[-10:]), 4),
        "documents_per_step_mean": round(sum(documents) / max(len(documents), 1), 2),
        "documents_per_step_min": min(documents, default=0),
        "step_seconds": round(sum(r["step_time_s"] for r in rows), 1),
        "validation_tokens": result["tokens"],
    }
    kept.write_text(json.dumps(measured))
    return measured


def rise_after_turns(run: dict, window: int) -> float:
    """The largest rise of the validation loss within `window` steps after an epoch turn
    over its last evaluation before the turn (0: never above it)."""
    rise, evaluated = 0.0, list(zip(run["steps"], run["val_loss"], strict=True))
    for turn in run["epoch_turns"]:
        before = [loss for step, loss in evaluated if step <= turn]
        after = [loss for step, loss in evaluated if turn < step <= turn + window]
        if before and after:
            rise = max(rise, max(after) - before[-1])
    return round(rise, 4)


def over_seeds(runs: list[dict]) -> dict:
    """An order's curve over its seeds: the mean validation loss at every evaluation (the
    steps every seed evaluated), its standard deviation, the first seed's epoch turns, and
    the mean (rise: largest) of the rest."""
    steps = sorted(set.intersection(*(set(run["steps"]) for run in runs)))
    per_step = [
        [dict(zip(run["steps"], run["val_loss"], strict=True))[step] for run in runs]
        for step in steps
    ]
    mean = [round(statistics.fmean(losses), 4) for losses in per_step]
    std = [round(statistics.stdev(losses), 4) if len(runs) > 1 else 0.0 for losses in per_step]
    averaged = ("train_loss_last_10", "documents_per_step_mean", "step_seconds")
    return {
        "steps": steps,
        "val_loss": mean,
        "val_loss_std": std,
        "epoch_turns": runs[0]["epoch_turns"],
        **{key: round(statistics.fmean(run[key] for run in runs), 4) for key in averaged},
        "documents_per_step_min": min(run["documents_per_step_min"] for run in runs),
        "rise_after_turns": max(run["rise_after_turns"] for run in runs),
    }


def gap(streamed: dict, prepared: dict) -> dict:
    """Streamed - prepared mean validation loss at every evaluation after warmup, with the
    standard error of that difference (the two orders' seeds are independent draws)."""
    n_streamed, n_prepared = len(streamed["seeds"]), len(prepared["seeds"])
    other = {
        step: (loss, std)
        for step, loss, std in zip(
            prepared["steps"], prepared["val_loss"], prepared["val_loss_std"], strict=True
        )
    }
    gaps, errors = [], []
    for step, loss, std in zip(
        streamed["steps"], streamed["val_loss"], streamed["val_loss_std"], strict=True
    ):
        if step > WARMUP and step in other:  # (a run may save off the interval)
            loss_p, std_p = other[step]
            gaps.append([step, round(loss - loss_p, 4)])
            errors.append(round(math.sqrt(std**2 / n_streamed + std_p**2 / n_prepared), 4))
    largest = max(range(len(gaps)), key=lambda i: abs(gaps[i][1]), default=None)
    return {
        "gap_streamed_minus_prepared": gaps,
        "gap_standard_error": errors,
        "largest_gap_after_warmup": None if largest is None else gaps[largest][1],
        "largest_gap_standard_error": None if largest is None else errors[largest],
        "mean_gap_after_warmup": round(statistics.fmean(g for _, g in gaps), 4) if gaps else None,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = result["corpora"]
    fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 4.5), squeeze=False)
    for axis, (name, corpus) in zip(axes[0], corpora.items(), strict=True):
        for order, run in corpus["orders"].items():
            label = f"{order} ({len(run['seeds'])} seeds: mean, ±1 std)"
            (line,) = axis.plot(run["steps"], run["val_loss"], marker=".", label=label)
            low = [m - s for m, s in zip(run["val_loss"], run["val_loss_std"], strict=True)]
            high = [m + s for m, s in zip(run["val_loss"], run["val_loss_std"], strict=True)]
            axis.fill_between(run["steps"], low, high, color=line.get_color(), alpha=0.15)
            for turn in run["epoch_turns"]:
                axis.axvline(turn, color=line.get_color(), alpha=0.25, linestyle="--")
        axis.set_title(f"{name} corpus ({corpus['epochs']:.1f} epochs)")
        axis.set_xlabel("step (dashed: epoch turns)")
        axis.set_ylabel("validation loss (same held-out windows)")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"{CONFIG}: streamed vs prepared, {result['steps']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpora", nargs="+", default=["embedded", "long"])
    parser.add_argument("--orders", nargs="+", default=list(ORDERS), choices=list(ORDERS))
    parser.add_argument(
        "--open-documents", nargs="*", type=int, default=[], metavar="N",
        help="more streamed orders: data.open_documents=N each (named 'N open')",
    )  # fmt: skip
    parser.add_argument(
        "--overrides", nargs="*", default=[], metavar="KEY=VALUE",
        help="config overrides of every run (e.g. data.readers=2)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--turn-window", type=int, default=100)
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=SEEDS,
        help="data.seed of each run (every order runs at each): the document orders",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="training runs at once")
    parser.add_argument(
        "--embedded-validation-fraction", type=float, default=0.05,
        help="the embedded corpus's held-out share (more: shorter epochs)",
    )  # fmt: skip
    parser.add_argument("--long-documents", type=int, default=LONG["documents"])
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads a run")
    parser.add_argument("--work", help="keep the corpora and runs here (default: a temporary dir)")
    parser.add_argument("--out", default="bench/results/stream_vs_prepared_cpu")
    args = parser.parse_args()
    orders = {order: ORDERS[order] for order in args.orders}
    orders.update({f"{n} open": [f"data.open_documents={n}"] for n in args.open_documents})
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # (every command's, inherited)
    from data_pipeline.build import build_tokenizer
    from data_pipeline.config import DataConfig

    started = time.perf_counter()
    tokenizer = build_tokenizer(DataConfig(), str(Path("~/.cache/belief-lm").expanduser())).path
    with contextlib.ExitStack() as stack:
        work = Path(args.work or stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        runs, heldout, corpora = {}, {}, {}  # (corpus, order, seed) -> (directory, overrides)
        for name in args.corpora:
            data = corpus_overrides(name, work, tokenizer, args)
            heldout[name] = held_out(data, work / f"{name}-heldout.jsonl")
            corpora[name] = {"overrides": data, "orders": {}}
            for order, extra in orders.items():
                if extra is None:
                    prepared = work / f"{name}-prepared"
                    if not (prepared / "train.idx").exists():  # (kept in --work)
                        cli("prepare", "--config", CONFIG, "--output", str(prepared),
                            "--workers", "2", *data)  # fmt: skip
                    extra = [f"data.sources=[prepared:{prepared}]"]
                for seed in args.seeds:
                    run_dir = work / f"{name}-{order.replace(' ', '-')}-s{seed}"
                    overrides = [*data, *extra, f"data.seed={seed}", *args.overrides]
                    runs[(name, order, seed)] = (run_dir, overrides)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            seconds = list(pool.map(lambda run: train(*run, args), runs.values()))
        for ((name, order, seed), (run_dir, _)), wall in zip(runs.items(), seconds, strict=True):
            run = {
                "wall_seconds": wall and round(wall, 1),
                **curve(run_dir, heldout[name], args.eval_batches),
            }
            run["rise_after_turns"] = rise_after_turns(run, args.turn_window)
            corpora[name]["orders"].setdefault(order, {"seeds": {}})["seeds"][seed] = run
            print(name, order, seed, json.dumps(run), flush=True)
    for corpus in corpora.values():
        for order in corpus["orders"].values():
            order.update(over_seeds(list(order["seeds"].values())))
        orders = corpus["orders"]
        if "streamed" in orders and "prepared" in orders:
            corpus.update(gap(orders["streamed"], orders["prepared"]))
        turns = next(iter(orders.values()))["epoch_turns"]
        epochs = len(turns) + (args.steps - turns[-1]) / turns[0] if turns else 0
        corpus["epochs"] = round(epochs, 2)
    out = Path(args.out)
    result = {
        "benchmark": "streamed vs prepared training of the same documents",
        "config": CONFIG, "steps": args.steps, "eval_interval": args.eval_interval,
        "eval_batches": args.eval_batches, "turn_window": args.turn_window, "jobs": args.jobs,
        "threads": args.threads, "embedded_validation_fraction": args.embedded_validation_fraction,
        "long_documents": args.long_documents, "overrides": args.overrides,
        "seeds": args.seeds,
        "corpora": corpora, "wall_seconds": round(time.perf_counter() - started),
        "plot": str(out.with_suffix(".png")),
    }  # fmt: skip
    plot(result, out.with_suffix(".png"))
    print("wrote", write_result(out.with_suffix(".json"), result, torch.device("cpu")))


if __name__ == "__main__":
    main()
