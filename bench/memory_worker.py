"""One measured case of bench/memory.py, in a process (or torchrun job) of its own.

    python bench/memory_worker.py OUT_DIR CONFIG [overrides...]
    torchrun --nproc_per_node=N bench/memory_worker.py OUT_DIR CONFIG [overrides...]

Builds the engine as training does (bench.common.bench_trainee: build_trainee) and runs
optimizer steps on random tokens, with torch's profiler recording every allocation of the
CPU allocator from before the model exists: the peak of bytes allocated is what
torch.cuda.max_memory_allocated would report on a GPU (memory touched or not, without the
Python and library baseline that resident memory includes). Then times more steps without
the profiler. Writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from belief_lm.config import load_config  # noqa: E402
from belief_lm.parallel.dims import ParallelDims  # noqa: E402
from belief_lm.parallel.env import detect  # noqa: E402
from belief_lm.parallel.grid import ProcessGrid  # noqa: E402
from belief_lm.runtime import select_device  # noqa: E402
from bench.common import bench_trainee  # noqa: E402

PROFILED_STEPS = 2
"""Steps under the profiler: Adam's moments appear in the first; the second is steady."""


def micro_batches(cfg, vocab: int):
    """Random token windows, a new one per micro-batch (the data do not matter here)."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    shape = (cfg.train.micro_batch_size, cfg.model.seq_length + 1)
    while True:
        rows = torch.randint(0, vocab, shape, generator=gen)
        yield rows[:, :-1], rows[:, 1:]


def step(trainee, data, phases: bool) -> None:
    """One optimizer step, as Trainee.train_step takes it, its phases marked for the
    profiler (forward, backward, the optimizer step at the accumulation boundary). The
    pipeline engine's 1F1B schedule is one call, without phases."""
    engine = trainee.engine
    if trainee.pipelined:
        trainee.train_step(data)
        return
    for _ in range(engine.gradient_accumulation_steps()):
        tokens, labels = next(data)
        with record_function("forward") if phases else _nothing():
            loss = engine(tokens, labels)
        with record_function("backward") if phases else _nothing():
            engine.backward(loss)
        with record_function("optimizer") if phases else _nothing():
            engine.step()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def allocation_profile(prof) -> dict:
    """Peak and starting bytes allocated within each marked range, from the profiler's
    memory events (allocations positive, frees negative, in time order)."""
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ranges = [
        (e.name(), e.start_ns(), e.end_ns())
        for e in events
        if e.name() in ("build", "forward", "backward", "optimizer", "step")
    ]
    times, totals, total = [], [], 0
    for t, nbytes in memory:
        total += nbytes
        times.append(t)
        totals.append(total)
    import bisect

    out: dict[str, list] = {}
    for name, start, end in sorted(ranges, key=lambda r: r[1]):
        i = bisect.bisect_left(times, start)
        j = bisect.bisect_right(times, end)
        before = totals[i - 1] if i else 0
        after = totals[j - 1] if j else 0
        peak = max(totals[i:j], default=before)
        out.setdefault(name, []).append({"start": before, "peak": max(peak, before), "end": after})
    return {"peak": max(totals, default=0), "phases": out}


def calibrate(cfg, grid: ProcessGrid) -> tuple[float, float | None]:
    """This process's fp32 matmul rate on the MLP's shape (FLOP/s), and the bus bandwidth
    of an all-reduce of one layer's activations over the tensor-parallel group (else the
    data-parallel group): the rates the planner's step time is evaluated at here."""
    layout = grid.layout
    model, tokens = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length
    a = torch.randn(tokens, model.hidden_size)
    b = torch.randn(model.hidden_size, model.ffn_size // layout.tensor)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    rate = 5 * 2 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - start)
    group = None
    if layout.tensor > 1:
        group = grid.tensor_group
    elif layout.data > 1:
        group = grid.data_group
    if group is None:
        return rate, None
    ranks = dist.get_world_size(group)
    x = torch.randn(tokens * model.hidden_size)
    dist.all_reduce(x, group=group)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(x, group=group)
    seconds = (time.perf_counter() - start) / 5
    return rate, 2 * (ranks - 1) / ranks * x.numel() * 4 / seconds


def main() -> None:
    out_dir, config, *overrides = sys.argv[1:]
    cfg = load_config(config, overrides)
    device = select_device("cpu")
    env = detect()
    dims = ParallelDims(env.world_size, cfg.parallel.tensor, cfg.parallel.pipeline)
    grid = ProcessGrid.join(env, device, dims, timeout_s=600)
    layout = grid.layout
    vocab = cfg.model.vocab_size
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("build"):
            # the bf16 cases measure DeepSpeed's bf16 engines on the CPU
            trainee = bench_trainee(cfg, grid, vocab, device)
        data = micro_batches(cfg, vocab)
        for _ in range(PROFILED_STEPS):
            with record_function("step"):
                step(trainee, data, phases=True)
    allocated = allocation_profile(prof)
    del prof
    rate, bandwidth = calibrate(cfg, grid)
    times = []
    for _ in range(int(os.environ.get("BENCH_TIMED_STEPS", "3"))):
        dist.barrier()
        start = time.perf_counter()
        step(trainee, data, phases=False)
        dist.barrier()
        times.append(time.perf_counter() - start)
    result = {
        "rank": dist.get_rank(),
        "layout": {"tensor": layout.tensor, "pipeline": layout.pipeline, "data": layout.data},
        "parameters": trainee.parameters,
        "allocated": allocated,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_build_bytes": rss_before,
        "step_times_s": times,
        "matmul_flops_per_s": rate,
        "all_reduce_bus_bytes_per_s": bandwidth,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
