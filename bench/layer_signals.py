"""What the per-layer signals cost (belief_lm/train/layer_signals.py): the diagnostics'
forward pass (largest attention score, output RMS; the belief diagnostics come with it)
and the per-layer gradient norms, against the time of a training step, averaged over
run.diagnostics_interval steps (issue 36: at most 5% on CPU).

    .venv/bin/python -m bench.layer_signals --config configs/tiny.yaml --interval 10

One process, ZeRO as the config says, random tokens. Each measurement is the median of
--repeats; the machine's other load shows in the spread (record it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from belief_lm.config import load_config
from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.env import detect
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.train.diagnostics import belief_diagnostics
from belief_lm.train.layer_signals import layer_grad_norms
from bench.common import bench_trainee, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--interval", type=int, default=10, help="run.diagnostics_interval")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default="bench/results/layer_signals_cpu.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    device = torch.device("cpu")
    grid = ProcessGrid.join(detect({}), device, ParallelDims(1, 1, 1))  # one process
    vocab = 4096
    trainee = bench_trainee(cfg, grid, vocab, device)
    ds = trainee.engine
    generator = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length)
    tokens = torch.randint(0, vocab, shape, generator=generator)
    accumulation = ds.gradient_accumulation_steps()

    def step(measure: bool) -> tuple[float, float]:
        """One optimizer step; (its seconds, the gradient norms' seconds within it)."""
        norms_s = 0.0

        def before_update():
            nonlocal norms_s
            started = time.perf_counter()
            layer_grad_norms(ds.module)
            norms_s = time.perf_counter() - started

        trainee.before_update = before_update if measure else None
        started = time.perf_counter()
        trainee.train_step(iter([(tokens, tokens)] * accumulation))
        return time.perf_counter() - started - norms_s, norms_s

    step(False)  # warm-up
    steps = [step(False)[0] for _ in range(args.repeats)]
    norms = [step(True)[1] for _ in range(args.repeats)]
    forward = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        belief_diagnostics(ds, tokens, tokens, pipelined=False)
        forward.append(time.perf_counter() - started)
    step_s, norms_s, forward_s = (statistics.median(x) for x in (steps, norms, forward))
    share = (norms_s + forward_s) / (args.interval * step_s)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "interval": args.interval,
        "step_s": step_s,
        "step_s_all": steps,
        "grad_norms_s": norms_s,
        "forward_signals_s": forward_s,
        "share_of_step_time_over_interval": share,
        "note": "shared 2-core machine (other engineers' runs): medians of --repeats",
    }
    print(
        f"step {step_s:.3f} s; gradient norms {norms_s * 1e3:.1f} ms; diagnostics forward "
        f"{forward_s * 1e3:.1f} ms; every {args.interval} steps: {share:.2%} of step time"
    )
    write_result(args.output, result, device)


if __name__ == "__main__":
    main()
