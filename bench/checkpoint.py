"""What a checkpoint costs: save time, load time, size, verification and the training stall,
written synchronously and in the background (checkpoint.async_save).

    python bench/checkpoint.py                         # llama-188m, llama-1b at 2 layers
    python bench/checkpoint.py --models llama-188m     # a subset

Each model runs in a process of its own (this file with --worker): one rank, fp32, ZeRO-1,
the real engine (bench.common.bench_trainee) on random tokens (sequences of 128, one per
step: the step only has to exist, the state is what is measured), its checkpoints written through
belief-lm's Checkpointer to the local disk (each file synced before it counts). Measured:
- sync: the time `save` takes (the training stall: the engine's state serialised, written,
  synced, checksummed as written, the manifest, the rename); its bytes and bytes per
  parameter;
- verify: every file checked against the manifest by size (a stat each), and read through
  for its CRC-32 on 1 and 4 threads (the page cache holds the files just written: a cold
  read is the disk's);
- load: DeepSpeed's load_checkpoint of it into the engine (warm page cache; every file
  read weights-only, belief_lm/checkpoint/loading.py);
- loading's cost: the check of every file's pickle against the allow-list
  (loading.refusals, what a resume and `checkpoint verify` add), and every file read once
  weights-only (loading.load) against once with plain pickle, side by side (warm cache);
- async: the time `save(wait=False)` takes (the copy to host memory: the stall training
  takes; the first save also allocates the host buffers the later ones reuse), then the
  steps trained while the thread writes, until the poll after a step publishes it: the
  background write's wall time and CPU time, and the steps' time during it against steps
  right after it. On this machine's two cores, shared with other work, the writer's CPU
  time competes with training's (a GPU computes while the host writes), and step times
  drift with the other work: the load average is recorded.
llama-1b does not fit here whole (1.24B parameters x 20 bytes of fp32 training state, plus
16 for the host copy of an async save, against 23 GB of RAM): it is measured at 2 of its 16
layers, so mostly its 263M-parameter embedding. Writes bench/results/checkpoint_cpu.json
with the projection of both stalls to 1B and 8B parameters (see `project`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "llama-188m": [],
    "llama-1b": ["model.num_layers=2"],
}
"""Presets measured, with what had to be cut for this machine's memory."""
SHAPE = [
    "model.seq_length=128", "train.micro_batch_size=1", "train.global_batch_size=1",
    "parallel.zero_stage=1", "train.precision=fp32", "model.attention=softmax",
]  # fmt: skip
BASELINE_STEPS = 3
"""Steps timed without a write in flight (their median is the step time)."""
REPEATS = 2
"""Synchronous saves and loads measured per model (the median is taken)."""
ASYNC_REPEATS = 3
"""Background saves measured per model: the first allocates its host buffers, the later
ones (their median is taken) copy into them."""

WRITE_GBS = 2.0
"""Write bandwidth a node gets from a parallel file system, assumed for the projection."""
COPY_GBS = 20.0
"""Device-to-pinned-host copy bandwidth per GPU, assumed for the projection (PCIe 5 x16
moves ~50 GB/s at best; 20 leaves room for eight GPUs sharing host memory bandwidth)."""
GPUS_PER_NODE = 8


def rss_gb() -> float:
    """This process's resident memory now, GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def worker(model: str, out: Path, scratch: Path) -> None:
    """Measure one model (in this process) and write its record to `out`."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from belief_lm.checkpoint import manifest
    from belief_lm.checkpoint.files import CheckpointInfo, problems
    from belief_lm.checkpoint.store import Checkpointer, rng_state
    from belief_lm.config import load_config, padded_vocab_size
    from belief_lm.parallel.dims import ParallelDims
    from belief_lm.parallel.env import detect
    from belief_lm.parallel.grid import ProcessGrid
    from bench.common import bench_trainee

    cfg = load_config(f"configs/model/{model}.yaml", [*SHAPE, *MODELS[model]])
    grid = ProcessGrid.join(detect({}), torch.device("cpu"), ParallelDims(1, 1, 1))
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model, 1)
    trainee = bench_trainee(cfg, grid, vocab, torch.device("cpu"))
    engine = trainee.engine
    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            rows = torch.randint(0, vocab, (1, cfg.model.seq_length + 1), generator=gen)
            yield rows[:, :-1], rows[:, 1:]

    data = batches()

    def step() -> float:
        started = time.perf_counter()
        trainee.train_step(data)
        return time.perf_counter() - started

    for _ in range(2):  # Adam's moments exist after the first step
        step()
    step_s = statistics.median(step() for _ in range(BASELINE_STEPS))
    print(f"{model}: {trainee.parameters:,} parameters, step {step_s:.2f} s, "
          f"{rss_gb():.1f} GB resident", flush=True)  # fmt: skip
    extra = {"config.yaml": cfg.to_yaml().encode()}

    def info(n: int) -> CheckpointInfo:
        return CheckpointInfo(n, 0, 1, 1, 1, 1, vocab)

    record: dict = {"model": model, "overrides": [*SHAPE, *MODELS[model]],
                    "parameters": trainee.parameters, "step_s": step_s}  # fmt: skip
    root = scratch / model
    sync = Checkpointer(engine, root / "sync", keep=1)
    saves, loads, verifies = [], [], {"sizes": [], "crc32_1_thread": [], "crc32_4_threads": []}
    reads: dict[str, list[float]] = {"pickle_check": [], "weights_only": [], "pickle": []}
    for n in range(1, REPEATS + 1):
        started = time.perf_counter()
        path = sync.save(info(n), {"rng": rng_state()}, extra, {})
        saves.append(time.perf_counter() - started)
        for name, args in (("sizes", (False, 1)), ("crc32_1_thread", (True, 1)),
                           ("crc32_4_threads", (True, 4))):  # fmt: skip
            started = time.perf_counter()
            assert not problems(path, *args)
            verifies[name].append(time.perf_counter() - started)
        started = time.perf_counter()
        engine.load_checkpoint(str(path.parent), tag=path.name)
        loads.append(time.perf_counter() - started)
        for name, seconds in read_every_file(path).items():
            reads[name].append(seconds)
        print(f"  sync save {saves[-1]:.1f} s, load {loads[-1]:.1f} s, {rss_gb():.1f} GB "
              "resident", flush=True)  # fmt: skip
    records = manifest.read_manifest(path)
    size = sum(r.size for r in records.values())
    record.update(
        checkpoint_bytes=size, bytes_per_parameter=size / trainee.parameters,
        files=len(records), sync_save_s=statistics.median(saves),
        load_s=statistics.median(loads),
        verify_s={k: statistics.median(v) for k, v in verifies.items()},
        read_s={k: statistics.median(v) for k, v in reads.items()},
    )  # fmt: skip
    record["sync_write_gbs"] = size / record["sync_save_s"] / 1e9
    shutil.rmtree(root / "sync")

    background = Checkpointer(engine, root / "async", keep=1, background=True)
    runs = []
    for n in range(1, ASYNC_REPEATS + 1):
        cpu_before = background.writer.cpu_seconds
        started = time.perf_counter()
        path = background.save(info(n), {"rng": rng_state()}, extra, {}, wait=False)
        copy_s = time.perf_counter() - started
        during = []
        while True:  # train on while it is written, as the loop does: poll after each step
            during.append(step())
            if background.poll() is not None:
                break
        write_s = time.perf_counter() - started
        assert not problems(path, checksums=True)
        # steps without a write right after: the baseline of this run (the machine is shared)
        alone = statistics.median(step() for _ in range(BASELINE_STEPS))
        slower = sum(during) - len(during) * alone
        runs.append({"copy_s": copy_s, "write_s": write_s, "steps_during": len(during),
                     "writer_cpu_s": background.writer.cpu_seconds - cpu_before,
                     "step_s_during": statistics.median(during), "step_s_after": alone,
                     "slower_steps_s": slower})  # fmt: skip
        print(f"  async copy {copy_s:.2f} s, written in {write_s:.1f} s over "
              f"{len(during)} steps, {rss_gb():.1f} GB resident", flush=True)  # fmt: skip
    # the first save allocates its host buffers (page faults); the later ones reuse them
    record["async"] = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
    record["async"]["first_copy_s"] = runs[0]["copy_s"]
    record["async"]["copy_gbs"] = size / record["async"]["copy_s"] / 1e9
    record["async"]["runs"] = runs
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shutil.rmtree(root)
    out.write_text(json.dumps(record, indent=1))


def read_every_file(path: Path) -> dict[str, float]:
    """Seconds to check every torch file of checkpoint `path` against the allow-list, and
    to read each once weights-only and once with plain pickle (the files are ours)."""
    import torch

    from belief_lm.checkpoint import loading

    files = sorted(path.rglob("*.pt"))
    started = time.perf_counter()
    assert loading.refusals(path) == []
    seconds = {"pickle_check": time.perf_counter() - started}
    for name, read in (("weights_only", loading.load),
                       ("pickle", lambda f: torch.load(f, weights_only=False))):  # fmt: skip
        started = time.perf_counter()
        for file in files:
            read(file)
        seconds[name] = time.perf_counter() - started
    return seconds


def measure(model: str, scratch: Path) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        command = [sys.executable, __file__, "--worker", model, str(out), str(scratch)]
        done = subprocess.run(command, cwd=ROOT, env=env, text=True, timeout=3600)
        if done.returncode:
            raise RuntimeError(f"{model}: worker failed ({done.returncode})")
        return json.loads(out.read_text())


def project(results: list[dict]) -> dict:
    """The stalls at 1B and 8B parameters from the largest model's bytes per parameter:
    sync, the checkpoint written at WRITE_GBS per node; async, each GPU's share copied to
    host memory at COPY_GBS (ZeRO-1 over the node's GPUS_PER_NODE data-parallel ranks: each
    writes its optimizer partition; the module file is one rank's, ~1/4 of the bytes at
    fp32, so the busiest GPU copies a little more than its share: taken as 1/8 + 1/4)."""
    largest = max(results, key=lambda r: r["parameters"])
    per_param = largest["bytes_per_parameter"]
    rows = {}
    for name, params in (("1B", 1e9), ("8B", 8e9)):
        size = per_param * params
        busiest = size * (1 / GPUS_PER_NODE + 0.25)
        rows[name] = {
            "checkpoint_gb": size / 1e9,
            "sync_stall_s": size / (WRITE_GBS * 1e9),
            "async_stall_s": busiest / (COPY_GBS * 1e9),
            "async_write_s": size / (WRITE_GBS * 1e9),
            "host_copy_gb_per_gpu": busiest / 1e9,
        }
    return {
        "bytes_per_parameter": per_param, "from": largest["model"],
        "write_gbs_per_node": WRITE_GBS, "copy_gbs_per_gpu": COPY_GBS,
        "gpus": GPUS_PER_NODE, "rows": rows,
    }  # fmt: skip


def table(results: list[dict]) -> str:
    lines = [
        "| model | parameters | checkpoint | bytes / parameter | sync save = stall | load "
        "| verify: sizes / CRC-32, 1 thread / 4 threads | async stall: copy (first save) "
        "| async write: wall (its CPU) | step alone / during the write |",
        "|---" * 10 + "|",
    ]
    for r in results:
        v, a = r["verify_s"], r["async"]
        lines.append(
            f"| {r['model']} | {r['parameters'] / 1e6:,.0f}M "
            f"| {r['checkpoint_bytes'] / 1e9:.2f} GB | {r['bytes_per_parameter']:.2f} "
            f"| {r['sync_save_s']:.1f} s ({r['sync_write_gbs']:.2f} GB/s) | {r['load_s']:.1f} s "
            f"| {v['sizes'] * 1e3:.1f} ms / {v['crc32_1_thread']:.1f} s / "
            f"{v['crc32_4_threads']:.1f} s | {a['copy_s']:.2f} s ({a['first_copy_s']:.1f} s) "
            f"| {a['write_s']:.0f} s ({a['writer_cpu_s']:.1f} s) "
            f"| {a['step_s_after']:.1f} s / {a['step_s_during']:.1f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default="bench/results/checkpoint_cpu.json")
    parser.add_argument("--scratch", default=None, help="where checkpoints are written "
                        "(default: a temporary directory on the local disk)")  # fmt: skip
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "OUT", "SCRATCH"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        model, out, scratch = args.worker
        worker(model, Path(out), Path(scratch))
        return
    print(f"load average {os.getloadavg()} (2 cores here)", flush=True)
    with tempfile.TemporaryDirectory(dir=args.scratch, prefix="bench-checkpoint-") as scratch:
        results = [measure(model, Path(scratch)) for model in args.models]
    import torch

    from bench.common import write_result

    projection = project(results)
    write_result(
        args.out,
        {
            "benchmark": "checkpoint save / load / verify time, size and training stall, "
            "synchronous and in the background (one rank, fp32, ZeRO-1, local disk)",
            "load_average_1_5_15min_at_end": os.getloadavg(),
            "results": results,
            "projection": projection,
        },
        torch.device("cpu"),
    )
    print(table(results))
    for r in results:
        read = r["read_s"]
        print(
            f"{r['model']}: every file's pickle checked in {read['pickle_check'] * 1e3:.0f} ms; "
            f"read weights-only {read['weights_only']:.2f} s, with pickle {read['pickle']:.2f} s"
        )
    for name, row in projection["rows"].items():
        print(f"{name}: {row['checkpoint_gb']:.0f} GB, sync stall {row['sync_stall_s']:.0f} s, "
              f"async stall {row['async_stall_s']:.1f} s")  # fmt: skip
    print("wrote", args.out)


if __name__ == "__main__":
    main()
