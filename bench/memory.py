"""The planner's memory (and step time) against measurement: belief-lm plan's model of a GPU
checked on the CPU allocator.

    python bench/memory.py                 # tiny, gpt2-124m, llama-188m: TP 1/2, ZeRO 0-3,
                                           # recompute none/selective/full (minutes)
    python bench/memory.py --models tiny   # a subset
    python bench/memory.py --sequence-parallel  # gpt2-124m, llama-188m at sequence 1024,
                                           # 2 layers: TP 2/4 with and without sequence
                                           # parallelism (bench/results/memory_sp_cpu.json)

Each case runs bench/memory_worker.py in a process (or torchrun job) of its own: the real
engine (build_trainee) on random tokens, belief_star, fp32 (and bf16 for tiny: DeepSpeed's
bf16 engines run on a CPU), sequences and batches shortened. Measured on every rank from
torch's profiler, which sees each allocation of the CPU allocator: the peak of bytes
allocated from before the model is built through two optimizer steps (what
torch.cuda.max_memory_allocated reports on a GPU: untouched memory counted, the Python and
library baseline not), what stays allocated through the second step's forward (weights,
optimizer state) and what its forward adds (activations). Predicted by belief_lm.plan for
the same layout. Step time: the median of 3 steps after the profiled ones, against the
planner's at this machine's measured matmul rate (MFU 1) and all-reduce bandwidth.
Writes bench/results/memory_cpu.json.

--sequence-parallel: the activations sequence parallelism saves (parallel.sequence_parallel,
issue 33), at the presets' sequence length with 2 layers, micro-batch 1, ZeRO-0: each
model at TP=2 and TP=4 with it on and off, and the ratio on/off of the activations the
second step's forward adds (and of the peak) on the most loaded rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from belief_lm import plan  # noqa: E402
from belief_lm.config import load_config  # noqa: E402

SHAPES = {
    "tiny": ["model.seq_length=128", "train.micro_batch_size=8", "model.vocab_size=4096"],
    "gpt2-124m": ["model.seq_length=128", "train.micro_batch_size=2"],
    "llama-188m": ["model.seq_length=128", "train.micro_batch_size=2"],
}
"""Shortened so that a case takes seconds to a minute on two CPU cores."""


LARGER = {
    "gpt2-124m": {(1, 1, 0, "none"), (1, 1, 1, "none"), (1, 1, 2, "none"), (1, 1, 3, "none"),
                  (2, 1, 1, "none"), (1, 2, 1, "none"), (1, 1, 0, "selective"),
                  (1, 1, 0, "full")},
    "llama-188m": {(1, 1, 0, "none"), (1, 1, 1, "none"), (1, 1, 2, "none"), (1, 1, 3, "none"),
                   (2, 1, 0, "none"), (2, 1, 1, "none"), (1, 1, 0, "selective")},
}  # fmt: skip
"""(TP, DP, ZeRO, recompute) cases of the larger models."""

SEQUENCE_PARALLEL_SHAPE = [
    "model.seq_length=1024", "model.num_layers=2", "train.micro_batch_size=1",
]  # fmt: skip
"""--sequence-parallel's shape: the presets' sequence, few layers (minutes a case)."""


def sequence_parallel_cases(models: list[str]) -> list[dict]:
    """Each model (but tiny) at TP 2 and 4, sequence parallelism on and off."""
    return [
        {"model": model, "tensor": tensor, "pipeline": 1, "data": 1, "zero": 0,
         "recompute": "none", "precision": "fp32", "sequence_parallel": on}
        for model in models if model != "tiny" for tensor in (2, 4) for on in (True, False)
    ]  # fmt: skip


def sequence_parallel_ratios(results: list[dict]) -> list[dict]:
    """Per model and TP: measured (and predicted) activations and peak, on / off."""
    by_case = {}
    for r in results:
        c = r["case"]
        by_case[c["model"], c["tensor"], c["sequence_parallel"]] = r
    ratios = []
    for (model, tensor, on), r in by_case.items():
        off = by_case.get((model, tensor, False))
        if not on or off is None:
            continue
        entry = {"model": model, "tensor": tensor}
        for source in ("measured", "predicted"):
            for key in ("activations", "peak"):
                entry[f"{source}_{key}_on_mb"] = r[source][key] / 1e6
                entry[f"{source}_{key}_off_mb"] = off[source][key] / 1e6
                entry[f"{source}_{key}_ratio"] = r[source][key] / off[source][key]
        entry["step_time_s_on"] = r["measured"]["step_time_s"]
        entry["step_time_s_off"] = off["measured"]["step_time_s"]
        ratios.append(entry)
    return ratios


def sequence_parallel_table(ratios: list[dict]) -> str:
    """docs' table: activations and peak per rank, on and off, and their ratio."""
    lines = [
        "| model | TP | activations MB off | on | on/off | predicted on/off "
        "| peak MB off | on | on/off | step s off | on |",
        "|---" * 11 + "|",
    ]
    for e in ratios:
        lines.append(
            f"| {e['model']} | {e['tensor']} | {e['measured_activations_off_mb']:,.1f} "
            f"| {e['measured_activations_on_mb']:,.1f} | {e['measured_activations_ratio']:.3f} "
            f"| {e['predicted_activations_ratio']:.3f} | {e['measured_peak_off_mb']:,.0f} "
            f"| {e['measured_peak_on_mb']:,.0f} | {e['measured_peak_ratio']:.3f} "
            f"| {e['step_time_s_off']:.2f} | {e['step_time_s_on']:.2f} |"
        )
    return "\n".join(lines)


def cases(model: str) -> list[dict]:
    """(layout, ZeRO, recompute, precision) cases of one model."""
    grid = [(1, 1, z, "none", "fp32") for z in (0, 1, 2, 3)]
    grid += [(2, 1, z, "none", "fp32") for z in (0, 1, 2, 3)]  # TP=2
    grid += [(1, 2, z, "none", "fp32") for z in (1, 3)]  # DP=2: ZeRO partitions
    grid += [(1, 1, 0, mode, "fp32") for mode in ("selective", "full")]
    if model == "tiny":  # bf16 on a CPU is slow: the small model only
        grid += [(1, 1, z, "none", "bf16") for z in (0, 1)]
    else:  # the larger models (minutes a case on two shared cores): fewer cases
        keep = LARGER[model]
        grid = [g for g in grid if g[:4] in keep]
    found = [
        {"model": model, "tensor": t, "pipeline": 1, "data": d, "zero": z, "recompute": r,
         "precision": p}
        for t, d, z, r, p in grid
    ]  # fmt: skip
    # the chunked loss (train.loss_chunk_tokens): 4 chunks of a micro-batch's tokens
    chunked = {
        "tiny": [(1, 0, "fp32"), (1, 1, "fp32"), (2, 0, "fp32"), (1, 0, "bf16")],
        "gpt2-124m": [(1, 0, "fp32")],
        "llama-188m": [],
    }[model]
    found += [
        {"model": model, "tensor": t, "pipeline": 1, "data": 1, "zero": z, "recompute": "none",
         "precision": p, "loss_chunk_tokens": 256 if model == "tiny" else 64}
        for t, z, p in chunked
    ]  # fmt: skip
    if model == "tiny":  # two pipeline stages, 4 micro-batches in flight on the first
        found += [
            {"model": model, "tensor": 1, "pipeline": 2, "data": 1, "zero": z,
             "recompute": "none", "precision": p, "accumulation": 4, **loss}
            for z, p, loss in ((0, "fp32", {}), (1, "fp32", {}), (0, "bf16", {}),
                               (0, "fp32", {"loss_chunk_tokens": 256}))
        ]  # fmt: skip
    return found


def overrides(case: dict) -> list[str]:
    shape = SHAPES[case["model"]]
    # the plain cases run without sequence parallelism (measured before it existed, and
    # predicted again by --resume as they ran); --sequence-parallel's set it both ways
    sequence_parallel = [
        f"parallel.sequence_parallel={str(case.get('sequence_parallel', False)).lower()}"
    ]
    if "sequence_parallel" in case:
        shape = SEQUENCE_PARALLEL_SHAPE
    micro = int(next(o for o in shape if o.startswith("train.micro")).split("=")[1])
    batch = micro * case["data"] * case.get("accumulation", 1)
    return [
        *shape, *sequence_parallel, "model.attention=belief_star",
        f"parallel.tensor={case['tensor']}", f"parallel.pipeline={case.get('pipeline', 1)}",
        f"parallel.zero_stage={case['zero']}",
        f"train.global_batch_size={batch}", "train.grad_clip=1.0",
        f"train.activation_checkpointing={case['recompute']}",
        f"train.precision={case['precision']}",
        f"train.loss_chunk_tokens={case.get('loss_chunk_tokens', 0)}",
    ]  # fmt: skip


def measure(case: dict, tries: int = 2, timed_steps: int = 3) -> list[dict]:
    """Run the worker for one case; every rank's record (a failed run is tried again: the
    machine this ran on is shared)."""
    nproc = case["tensor"] * case.get("pipeline", 1) * case["data"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "BENCH_TIMED_STEPS": str(timed_steps)}  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", str(ROOT / "bench/memory_worker.py"), out,
            f"configs/model/{case['model']}.yaml", *overrides(case),
        ]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=1800)  # fmt: skip
        if done.returncode and tries > 1:
            print(f"{case}: worker failed, trying again\n{done.stderr[-2000:]}", flush=True)
            time.sleep(30)
            return measure(case, tries - 1, timed_steps)
        if done.returncode:
            raise RuntimeError(f"{case}: worker failed\n{done.stderr[-4000:]}")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def predict(case: dict, measured: dict) -> dict:
    """belief_lm.plan's numbers for the case, its step time at the rates measured here."""
    cfg = load_config(f"configs/model/{case['model']}.yaml", overrides(case))
    candidate = plan.Candidate(
        case["tensor"], case.get("pipeline", 1), case["data"], case["zero"],
        cfg.train.micro_batch_size, case["recompute"], case.get("accumulation", 1),
        cfg.parallel.sequence_parallel_on,
    )  # fmt: skip
    bf16 = case["precision"] == "bf16"
    vocab = cfg.model.vocab_size
    memory = plan.memory(cfg, candidate, vocab, bf16)
    machine = plan.Machine(
        gpus=candidate.tensor * candidate.pipeline * candidate.data, memory_gb=0, gpus_per_node=8,
        peak_tflops=measured["matmul_gflops"] / 1e3, mfu=1.0,
        bandwidth_gbs=measured["all_reduce_gbs"] or 1.0,
    )  # fmt: skip
    compute, communication = plan.step_time(cfg, candidate, machine, vocab, bf16)
    return {
        "peak": memory.peak, "resident": memory.resident, "activations": memory.activations,
        "step_time_s": compute + communication, "compute_s": compute,
        "communication_s": communication, "parameters": memory.parameters,
    }  # fmt: skip


def measured(ranks: list[dict]) -> dict:
    """The most loaded rank's numbers (ranks of a layout differ by a few KB; pipeline
    stages by more). A pipelined step has no forward phase to split off."""
    worst = max(ranks, key=lambda r: r["allocated"]["peak"])
    bandwidth = [r["all_reduce_bus_bytes_per_s"] for r in ranks if r["all_reduce_bus_bytes_per_s"]]
    forward = worst["allocated"]["phases"].get("forward", [None])[-1]  # the second step's
    times = [t for r in ranks for t in r["step_times_s"]]
    return {
        "peak": worst["allocated"]["peak"],
        "resident": forward["start"] if forward else None,
        "activations": forward["end"] - forward["start"] if forward else None,
        "step_time_s": statistics.median(times),
        "rss_growth": max(r["peak_rss_bytes"] - r["rss_before_build_bytes"] for r in ranks),
        "matmul_gflops": statistics.median(r["matmul_flops_per_s"] for r in ranks) / 1e9,
        "all_reduce_gbs": statistics.median(bandwidth) / 1e9 if bandwidth else None,
        "phases": worst["allocated"]["phases"],  # bytes at start / peak / end of each
    }  # fmt: skip


def error(predicted: float, actual: float) -> float:
    return 100 * (predicted - actual) / actual


def row(result: dict) -> str:
    c, p, m = result["case"], result["predicted"], result["measured"]
    pipeline = f" PP{c['pipeline']}" if c.get("pipeline", 1) > 1 else ""
    layout = f"TP{c['tensor']}{pipeline} DP{c['data']} ZeRO-{c['zero']}"
    if "sequence_parallel" in c:
        layout += " SP" if c["sequence_parallel"] else " no SP"
    mb = 1e6
    if m["activations"] is None:  # pipelined: the peak only
        split = f"| {p['activations'] / mb:,.1f} | – | – | – "
    else:
        split = (
            f"| {p['activations'] / mb:,.1f} | {m['activations'] / mb:,.1f} "
            f"| {error(p['activations'], m['activations']):+.1f}% "
            f"| {error(p['resident'], m['resident']):+.1f}% "
        )
    return (
        f"| {c['model']} | {layout} | {c['recompute']} | {c['precision']} "
        f"| {c.get('loss_chunk_tokens', '–')} "
        f"| {p['peak'] / mb:,.0f} | {m['peak'] / mb:,.0f} | {error(p['peak'], m['peak']):+.1f}% "
        f"{split}| {m['step_time_s']:.2f} | {p['step_time_s']:.2f} |"
    )


HEADER = (
    "| model | layout | recompute | precision | loss chunk | predicted peak MB "
    "| measured peak MB | error | predicted activations MB | measured | error | resident error "
    "| step s measured | step s predicted (MFU 1) |\n" + "|---" * 14 + "|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument(
        "--out",
        help="default bench/results/memory_cpu.json (--sequence-parallel: memory_sp_cpu.json)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="TP 2/4 with and without sequence parallelism at sequence 1024, 2 layers",
    )
    parser.add_argument("--timed-steps", type=int, default=3, help="steps timed per case")
    parser.add_argument(
        "--resume", action="store_true",
        help="keep the measurements --out already holds (predicted again), run the rest",
    )  # fmt: skip
    args = parser.parse_args()
    if args.out is None:
        name = "memory_sp_cpu" if args.sequence_parallel else "memory_cpu"
        args.out = f"bench/results/{name}.json"
    results = []
    if args.resume and Path(args.out).exists():
        results = json.loads(Path(args.out).read_text())["results"]
        for result in results:
            result["predicted"] = predict(result["case"], result["measured"])
    if args.sequence_parallel:
        todo = sequence_parallel_cases(args.models)
    else:
        todo = [case for model in args.models for case in cases(model)]
    for case in todo:
        if any(r["case"] == case for r in results):
            continue
        ranks = measure(case, timed_steps=args.timed_steps)
        actual = measured(ranks)
        predicted = predict(case, actual)
        results.append(
            {"case": case, "overrides": overrides(case), "predicted": predicted,
             "measured": actual}
        )  # fmt: skip
        print(row(results[-1]), flush=True)
        write(args.out, results)
    write(args.out, results)  # (with --resume alone: the predictions made again)
    print(HEADER)
    for result in results:
        print(row(result))
    if args.sequence_parallel:
        print(sequence_parallel_table(sequence_parallel_ratios(results)))
    errors = [abs(error(r["predicted"]["peak"], r["measured"]["peak"])) for r in results]
    print(f"largest peak error {max(errors):.1f}%; {sum(e > 15 for e in errors)} cases beyond 15%")
    print("wrote", args.out)


def write(path: str, results: list[dict]) -> None:
    import torch

    from bench.common import write_result

    errors = [abs(error(r["predicted"]["peak"], r["measured"]["peak"])) for r in results]
    write_result(
        path,
        {
            "benchmark": "belief-lm plan's peak memory per GPU and step time vs measured on "
            "the CPU allocator (torch profiler), one process or torchrun job per case",
            "largest_peak_error_percent": max(errors),
            "cases_beyond_15_percent": sum(e > 15 for e in errors),
            "sequence_parallel_ratios": sequence_parallel_ratios(
                [r for r in results if "sequence_parallel" in r["case"]]
            ),
            "results": results,
        },
        torch.device("cpu"),
    )


if __name__ == "__main__":
    main()
