"""Forward+backward time of every attention variant relative to softmax, one model size.

    python bench/attention_overhead.py                         # CPU, fp32, small model
    python bench/attention_overhead.py --device cuda --dtype bf16 \
        --model configs/model/gpt2-124m.yaml --batch 8          # GPU

Times the whole model (embedding, layers, head, loss, backward) with torch.utils.benchmark
on identical inputs, the variants interleaved over several rounds; writes JSON to
bench/results/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.utils.benchmark as benchmark

from belief_lm.config import load_config
from belief_lm.model.gpt import BeliefLM
from belief_lm.parallel.gather import count_model_parameters
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.runtime import select_device
from belief_lm.variants import VARIANTS
from bench.common import write_result

SMALL_CPU_MODEL = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=768",
    "model.seq_length=256",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="configs/model/tiny.yaml")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5, help="turns of every variant")
    parser.add_argument(
        "--min-run-time", type=float, default=1.0, help="seconds per variant per round"
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--fused", action="store_true", help="model.compile=projections (torch.compile)"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="model overrides (default: a small CPU size)")
    args = parser.parse_args()

    overrides = args.overrides or (SMALL_CPU_MODEL if args.device == "cpu" else [])
    fused = ["model.compile=projections"] if args.fused else []
    model_cfg = load_config(args.model, [*overrides, *fused]).model
    device = select_device(args.device)
    ProcessGrid.single_process()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, model_cfg.seq_length)
    tokens = torch.randint(0, args.vocab, shape, generator=gen).to(device)
    labels = torch.randint(0, args.vocab, shape, generator=gen).to(device)

    timers, parameters = {}, {}
    for variant in dict.fromkeys(["softmax", *args.variants]):  # softmax is the baseline
        cfg = model_cfg.model_copy(update={"attention": variant})
        model = BeliefLM(cfg, args.vocab).to(device=device, dtype=dtype)

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(tokens, labels).backward()

        timers[variant] = benchmark.Timer(
            "step()", globals={"step": step}, num_threads=torch.get_num_threads()
        )
        timers[variant].timeit(2)  # warm-up (allocator, kernels, compilation)
        parameters[variant] = count_model_parameters(model)
    # Variants take turns, round after round, so that a slow spell of the machine hits all
    # of them alike; each variant's number is the median over all its timed steps.
    times = {variant: [] for variant in timers}
    for _ in range(args.rounds):
        for variant, timer in timers.items():
            times[variant] += timer.blocked_autorange(min_run_time=args.min_run_time).times
    rows = {}
    for variant, samples in times.items():
        quartiles = statistics.quantiles(samples, n=4)
        rows[variant] = {
            "median_ms": statistics.median(samples) * 1e3,
            "iqr_ms": (quartiles[2] - quartiles[0]) * 1e3,
            "runs": len(samples),
            "parameters": parameters[variant],
        }
        print(f"{variant:16s} {rows[variant]['median_ms']:9.2f} ms", flush=True)
    base = rows["softmax"]["median_ms"]
    for row in rows.values():
        row["relative_to_softmax"] = row["median_ms"] / base

    suffix = "_fused" if args.fused else ""
    out = args.out or f"bench/results/attention_overhead_{args.device}{suffix}.json"
    result = {
        "benchmark": "forward+backward of the whole model, per attention variant",
        "model": model_cfg.model_dump(mode="json"),
        "batch": args.batch,
        "vocab": args.vocab,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "variants": rows,
    }
    print("wrote", write_result(out, result, device))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
