"""One command that characterises a GPU for belief-lm: correctness first, then throughput.

    python bench/gpu.py --out OUT.json        # on a GPU, within --time-limit (450 s)
    python bench/gpu.py --paper --out OUT.json  # the paper configs at one GPU's batch share
    python bench/gpu.py --overhead --out OUT.json  # belief-lm's step against plain PyTorch
    python bench/gpu.py --smoke [--paper | --overhead]  # the same code on CPU, tiny (CI)
    torchrun --nproc_per_node=2 bench/gpu.py --tensor 2 \
        --option sequence_parallel --option no_sequence_parallel   # on 2 GPUs: TP=2

Correctness: 50 steps of `tiny` in bf16 against fp32 from the same weights and batches
(loss within --loss-tolerance, relative, at every step; --smoke: 5 steps, in bf16 on the
CPU); the SDPA kernel every attention variant runs at each preset's shape (flash / cudnn /
efficient / math, from the profiler: variants with masks may fall back), and under
model.attention_mask=document the kernel the code chooses there (attention.document_kernel:
FlexAttention on CUDA) and the SDPA kernels that still run (none should be math); belief's
inner products computed from the model's own bf16 activations (dtype, and error against
fp64); the NCCL process group (TP=1).

Throughput: each model x attention x option set (OPTION_SETS by name: plain, fused, the
other fast paths one at a time, all of them as `tuned`; or named config overrides, e.g.
fused=model.compile=projections) at the preset's sequence length and the largest
micro-batch that fits (doubling until out of memory, then one step between), timed as the
trainer runs: `build_trainee` (DeepSpeed, bf16, ZeRO-1, the project's AdamW) and the loop's
own `train_step`, on synthetic tokens (no data loading: the loader's workers run ahead of
the GPU). Warm-up steps excluded, median step time of the rest; TFLOP/s and MFU from
belief_lm.train.flops. The JSON is rewritten after every run, so a run cut short still
leaves its results; a run that fails is recorded with its error and the exit code is 1.

--overhead: bench/step_overhead.py's comparison in bf16 on the GPU: belief-lm's step
(DeepSpeed's bf16 engine, as training builds it) against a plain PyTorch loop of the same
shapes (autocast bf16 over fp32 weights, torch's AdamW, clip_grad_norm_), their steps
alternating, at each model's shape (--models x --attentions, --overhead-micro-batch);
median step times and their ratio (issue 35).

--paper: 50 steps of each configs/paper/*.yaml at one GPU's share of its global batch
(global / (nodes x GPUs), the same micro-batch and accumulation as one rank of the real
run) on synthetic tokens; tokens/s and memory measured, the full run's time on its GPUs
PROJECTED from that rate (perfect data-parallel scaling assumed; labelled as such).

--tensor N (under torchrun, N ranks): the throughput runs at tensor parallelism N, one
micro-batch (--max-micro-batch, no search: an out-of-memory on one rank would leave the
others in a collective), step time and each rank's peak memory (the largest reported);
of the correctness checks only the process group's (the others are one GPU's: run them
without --tensor). The option sets sequence_parallel and no_sequence_parallel measure
parallel.sequence_parallel on and off; each on-run records its peak memory and step time
relative to the off-run's (issue 33; bench/memory.py measures the same on the CPU).
"""

from __future__ import annotations

import argparse
import functools
import gc
import glob
import itertools
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from belief_lm import attention as family
from belief_lm.config import Config, load_config
from belief_lm.model.attention_layer import CAPTURE
from belief_lm.model.gpt import BeliefLM
from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.env import detect
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.runtime import select_device
from belief_lm.train.flops import flops_per_token, peak_tflops
from belief_lm.variants import VARIANTS
from bench.common import bench_trainee, write_result

MODELS = {
    "gpt2-124m": "configs/model/gpt2-124m.yaml",
    "llama-188m": "configs/model/llama-188m.yaml",
}
ATTENTIONS = ["softmax", "belief", "belief_star"]
FAST_PATHS = [
    "model.compile=projections", "model.fused_output_projection=true",
    "train.loss_chunk_tokens=4096", "model.compile=layer",
]  # fmt: skip
OPTION_SETS = {
    "plain": [],
    "fused": FAST_PATHS[:1],  # the belief projections compiled
    "fused_output": FAST_PATHS[1:2],  # belief_star's [W^o | W^s] as one GEMM
    "chunked_loss": FAST_PATHS[2:3],  # no fp32 logits kept: larger micro-batches
    "compiled": FAST_PATHS[3:],  # each whole decoder layer compiled
    "tuned": FAST_PATHS,  # all of them
    "foreach_adamw": ["train.adamw_kernel=foreach"],
    "documents": ["model.attention_mask=document"],  # on documents of DOCUMENT_TOKENS
    "documents_compiled": ["model.attention_mask=document", "model.compile=layer"],
    # at --tensor > 1: the activations outside the tensor-parallel region split over it
    "sequence_parallel": ["parallel.sequence_parallel=true"],
    "no_sequence_parallel": ["parallel.sequence_parallel=false"],
}
"""Named option sets, for `--option NAME`; each a list of config overrides."""
DOCUMENT_END, DOCUMENT_TOKENS = 2, 256
"""Under model.attention_mask=document the synthetic tokens hold documents: an EOS id (a
trained tokenizer's) ends one every DOCUMENT_TOKENS tokens on average (the embedded
corpus's documents are about 200 tokens long: bench/document_mask.py)."""
OPTIONS = ["plain", "fused", "tuned"]
"""The GPU run's default matrix (within --time-limit); the single fast paths by name:
--option plain --option fused_output --option chunked_loss --option compiled."""
SMOKE_OPTIONS = ["plain", "foreach_adamw"]  # no compile on CPU (minutes)
SMOKE_SHAPE = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8",
    "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=512",
]  # fmt: skip
SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
OOM = torch.cuda.OutOfMemoryError


class Bench:
    """Arguments, device and the result being built (written out after every phase)."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.started = time.perf_counter()
        self.result: dict = {"benchmark": "bench/gpu.py", "smoke": args.smoke, "runs": []}
        self.errors = 0

    def config(self, path: str, *overrides: str) -> Config:
        shape = SMOKE_SHAPE if self.args.smoke else []
        return load_config(path, [*shape, f"parallel.tensor={self.args.tensor}", *overrides])

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def out_of_time(self) -> bool:
        return self.elapsed() > self.args.time_limit

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        if dist.get_rank() == 0:  # the ranks of --tensor agree (their peaks gathered)
            write_result(self.args.out, self.result, self.device)

    def record_error(self, entry: dict, err: Exception) -> None:
        entry["error"] = f"{type(err).__name__}: {err}"
        self.errors += 1
        print(f"  FAILED: {entry['error']}", flush=True)


def main() -> None:
    args = parse_args()
    device = select_device("cpu" if args.smoke else "cuda")
    env = detect()
    if env.world_size != args.tensor:
        raise SystemExit(
            f"--tensor {args.tensor}: run under torchrun --nproc_per_node={args.tensor} "
            f"(this world has {env.world_size} processes)"
        )
    grid = ProcessGrid.join(env, device, ParallelDims(env.world_size, args.tensor, 1))
    if args.out is None:
        name = "cpu_smoke" if args.smoke else slug(torch.cuda.get_device_name(device))
        mode = "paper_" if args.paper else "overhead_" if args.overhead else ""
        args.out = f"bench/results/gpu_{mode}{name}.json"
    bench = Bench(args, device)
    bench.result |= libraries(device)
    if args.paper:
        paper_runs(bench, grid)
    elif args.overhead:
        overhead_runs(bench, grid)
    elif args.tensor > 1:  # one GPU's checks are the TP=1 run's
        bench.result["correctness"] = {"process_group": process_group(device, grid)}
        throughput(bench, grid)
    else:
        bench.result["correctness"] = correctness(bench, grid)
        bench.save()
        throughput(bench, grid)
    bench.save()
    if dist.get_rank() == 0:
        print(markdown_table(bench.result), flush=True)
        print("wrote", args.out, f"({bench.elapsed():.0f} s)")
    dist.barrier()  # no rank leaves while another still talks to it (gloo: peer closed)
    sys.exit(1 if bench.errors else 0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="result JSON (default bench/results/gpu_<device>.json)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, few steps")
    parser.add_argument("--paper", action="store_true", help="the configs/paper runs instead")
    parser.add_argument(
        "--overhead", action="store_true", help="belief-lm's step against plain PyTorch instead"
    )
    parser.add_argument("--overhead-micro-batch", type=int, help="(default 8; smoke 2)")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="STEPS",
        help="--overhead: also profile STEPS steps of each loop (CPU time by phase, top ops)",
    )  # fmt: skip
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--attentions", nargs="+", default=ATTENTIONS, choices=list(VARIANTS))
    parser.add_argument(
        "--option",
        action="append",
        metavar="NAME[=KEY=VALUE,...]",
        help="an option set: one of " + ", ".join(OPTION_SETS) + ", or a name and the "
        "config overrides it applies, comma-separated (repeat for several; default: "
        f"{' '.join(OPTIONS)})",
    )
    parser.add_argument(
        "--tensor", type=int, default=1,
        help="tensor parallelism of the throughput runs (torchrun --nproc_per_node=N): one "
        "micro-batch, --max-micro-batch, no search",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, help="timed steps per run (default 10; smoke 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 3; smoke 1)")
    parser.add_argument("--max-micro-batch", type=int, help="probe cap (default 128; smoke 4)")
    parser.add_argument("--check-steps", type=int, help="bf16 vs fp32 steps (default 50)")
    parser.add_argument(
        "--loss-tolerance",
        type=float,
        default=0.02,
        help="bf16 vs fp32: largest allowed |loss difference| / fp32 loss at any step",
    )
    parser.add_argument("--paper-steps", type=int, help="steps per paper config (default 50)")
    parser.add_argument(
        "--time-limit", type=float, default=450, help="seconds; later runs are skipped"
    )
    args = parser.parse_args()
    if args.tensor > 1 and (args.paper or args.overhead):
        parser.error("--tensor: the throughput runs only (not --paper or --overhead)")
    small = args.smoke
    defaults = {"steps": (10, 2), "warmup": (3, 1), "max_micro_batch": (128, 4)}
    defaults |= {"check_steps": (50, 5), "paper_steps": (50, 4), "overhead_micro_batch": (8, 2)}
    for key, (full, smoke) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if small else full)
    args.options = dict(
        parse_option(o) for o in args.option or (SMOKE_OPTIONS if small else OPTIONS)
    )
    return args


def parse_option(text: str) -> tuple[str, list[str]]:
    """A named option set (OPTION_SETS), or NAME=KEY=VALUE[,KEY=VALUE...] (NAME=: none)."""
    name, equals, overrides = text.partition("=")
    if not equals and name in OPTION_SETS:
        return name, OPTION_SETS[name]
    if not name or not equals:
        raise SystemExit(
            f"--option {text!r}: expected one of {', '.join(OPTION_SETS)}, or "
            "NAME=KEY=VALUE[,KEY=VALUE...] or NAME="
        )
    return name, [o for o in overrides.split(",") if o]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def libraries(device: torch.device) -> dict:
    """What the numbers depend on beyond bench/common's package versions."""
    cuda = device.type == "cuda"
    return {
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,  # a tuple
        "peak_tflops": peak_tflops(device, None),
        "gpu_memory_gb": torch.cuda.get_device_properties(device).total_memory / 1e9
        if cuda
        else None,
    }


# ---- synthetic data and timed steps -----------------------------------------------------


def token_batches(
    vocab: int, batch: int, seq: int, seed: int, device, count: int = 1, documents: bool = False
) -> list[tuple]:
    """`count` micro-batches (tokens, labels) [batch, seq] of a seeded bigram chain: each
    token is followed by a fixed successor 3 times in 4, else by a random token, so a model
    can learn it (the loss falls) and two runs see the same data. With `documents`, one
    token in DOCUMENT_TOKENS is an EOS (DOCUMENT_END) ending a document."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=gen)
    out = []
    for _ in range(count):
        chain = torch.empty(batch, seq + 1, dtype=torch.long)
        chain[:, 0] = torch.randint(vocab, (batch,), generator=gen)
        noise = torch.randint(vocab, (batch, seq), generator=gen)
        keep = torch.rand(batch, seq, generator=gen) < 0.75
        for i in range(seq):
            chain[:, i + 1] = torch.where(keep[:, i], successor[chain[:, i]], noise[:, i])
        if documents:
            ends = torch.rand(chain.shape, generator=gen) < 1 / DOCUMENT_TOKENS
            chain = chain.masked_fill(ends, DOCUMENT_END)
        out.append((chain[:, :-1].to(device), chain[:, 1:].to(device)))
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(trainee, batches, steps: int, device) -> tuple[list[float], list[float]]:
    """Seconds and loss of each of `steps` training steps (optimizer step included)."""
    times, losses = [], []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        loss = trainee.train_step(batches).loss
        losses.append(loss.item())  # host-device sync: waits for the whole step
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times, losses


def trainee_of(cfg: Config, grid, device):
    """The model of `cfg` in its engine (bf16 where it asks for it: on the CPU too, for
    --smoke)."""
    return bench_trainee(cfg, grid, cfg.model.vocab_size, device, eos_id=DOCUMENT_END)


def batches_for(cfg: Config, micro_batch: int, seed: int, device, count: int = 1) -> list[tuple]:
    """token_batches for `cfg`'s shape, with documents under its document mask."""
    documents = cfg.model.attention_mask == "document"
    shape = (cfg.model.vocab_size, micro_batch, cfg.model.seq_length)
    return token_batches(*shape, seed=seed, device=device, count=count, documents=documents)


def release(trainee) -> None:
    """Drop an engine's hooks and return freed memory (callers drop their references)."""
    if trainee is not None and hasattr(trainee.engine, "destroy"):
        trainee.engine.destroy()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return None  # for `trainee = release(trainee)`


# ---- correctness ------------------------------------------------------------------------


def correctness(bench: Bench, grid) -> dict:
    checks = {"process_group": process_group(bench.device, grid)}
    print("process group:", checks["process_group"], flush=True)
    checks["bf16_vs_fp32"] = bf16_against_fp32(bench, grid)
    fused = any("model.compile=projections" in o for o in bench.args.options.values())
    checks["sdpa_kernels"], checks["belief_inner_products"] = {}, {}
    checks["document_kernels"] = {}
    for preset in bench.args.models:
        kernels, products = attention_checks(bench, preset, fused)
        checks["sdpa_kernels"][preset], checks["belief_inner_products"][preset] = kernels, products
        checks["document_kernels"][preset] = document_checks(bench, preset)
    return checks


def process_group(device: torch.device, grid: ProcessGrid) -> dict:
    """The world this process joined (nccl on GPU) and one all-reduce through it."""
    ones = torch.ones(4, device=device)
    dist.all_reduce(ones)
    return {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "tensor_parallel": grid.layout.tensor,
        "all_reduce_ok": bool((ones == dist.get_world_size()).all()),
    }


def bf16_against_fp32(bench: Bench, grid) -> dict:
    """`tiny` trained in bf16 and in fp32 from the same seed (same initial weights) on the
    same batches, through DeepSpeed's bf16 engine on CPU too (smoke: bench_trainee)."""
    steps = bench.args.check_steps
    vocab = [] if bench.args.smoke else ["model.vocab_size=4096"]
    curves = []
    for precision in ("fp32", "bf16"):
        cfg = bench.config(
            "configs/tiny.yaml", *vocab, f"train.precision={precision}",
            f"train.max_steps={steps}", "train.warmup_steps=5", *batch_overrides(16),
        )  # fmt: skip
        shape = (cfg.model.vocab_size, 16, cfg.model.seq_length)
        batches = token_batches(*shape, seed=0, device=bench.device, count=16)
        trainee = trainee_of(cfg, grid, bench.device)
        curves.append(timed_steps(trainee, itertools.cycle(batches), steps, bench.device)[1])
        release(trainee)
        del trainee
    reference, other = curves
    relative = [abs(a - b) / abs(a) for a, b in zip(reference, other, strict=True)]
    result = {
        "model": "tiny",
        "steps": steps,
        "precision": "bf16",
        "tolerance_relative": bench.args.loss_tolerance,
        "max_relative_difference": max(relative),
        "max_abs_difference": max(abs(a - b) for a, b in zip(reference, other, strict=True)),
        "loss_fp32": reference,
        "loss_bf16": other,
        "pass": max(relative) <= bench.args.loss_tolerance and reference[-1] < reference[0],
    }
    print(f"bf16 vs fp32: max relative loss difference {max(relative):.4f}", flush=True)
    if not result["pass"]:
        bench.errors += 1
    return result


def attention_checks(bench: Bench, preset: str, fused: bool) -> tuple[dict, dict]:
    """At the preset's width, heads and sequence (one layer, micro-batch 1, bf16): the
    SDPA kernels each variant runs in forward and backward, and belief's inner products
    from the model's own activations."""
    dtype = torch.bfloat16
    kernels, products = {}, {}
    for variant in VARIANTS:
        cfg = bench.config(MODELS[preset], f"model.attention={variant}", "model.num_layers=1")
        model = BeliefLM(cfg.model, cfg.model.vocab_size).to(bench.device, dtype)
        tokens, labels = batches_for(cfg, 1, seed=0, device=bench.device)[0]
        kernels[variant] = kernels_run(model, tokens, labels)
        if variant == "belief":  # the layer's MH and V, from a forward in evaluation mode
            captured = {}
            scope = CAPTURE.set(captured)
            model.eval()
            with torch.no_grad():
                model(tokens)
            CAPTURE.reset(scope)
            products = inner_product_check(captured[1]["mh"], captured[1]["v"], fused)
        del model
    print(f"{preset} SDPA kernels:", kernels, flush=True)
    print(f"{preset} belief inner products:", products, flush=True)
    return kernels, products


def kernels_run(model, tokens, labels) -> list[str]:
    """The SDPA kernels a forward and backward of `model` ran (from the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(tokens, labels).backward()
    names = {event.name for event in profile.events()}
    return sorted({SDPA_KERNELS[n] for n in names if n in SDPA_KERNELS})


def document_checks(bench: Bench, preset: str) -> dict:
    """Under model.attention_mask=document, at the preset's shape (one layer, micro-batch
    1, bf16, documents of DOCUMENT_TOKENS): the kernel the code chooses on this device and
    the SDPA kernels each variant still runs (FlexAttention's own are not SDPA's)."""
    chosen = family.document_kernel(bench.device)
    out = {"document_kernel": chosen, "sdpa_kernels": {}}
    for variant in VARIANTS:
        cfg = bench.config(MODELS[preset], f"model.attention={variant}", "model.num_layers=1",
                           "model.attention_mask=document")  # fmt: skip
        model = BeliefLM(cfg.model, cfg.model.vocab_size, eos_id=DOCUMENT_END)
        model = model.to(bench.device, torch.bfloat16)
        tokens, labels = batches_for(cfg, 1, seed=0, device=bench.device)[0]
        out["sdpa_kernels"][variant] = kernels_run(model, tokens, labels)
        del model
    out["pass"] = all("math" not in k for k in out["sdpa_kernels"].values())
    if not out["pass"]:
        bench.errors += 1
    print(f"{preset} document mask: {chosen}; SDPA kernels {out['sdpa_kernels']}", flush=True)
    return out


def inner_product_check(mh: torch.Tensor, v: torch.Tensor, fused: bool) -> dict:
    """<MH, V> and <V, V> as the model computes them (the plain and, if in use, the
    compiled step) against fp64, the error scaled by |MH||V| (Cauchy-Schwarz), beside the
    error that accumulating in the activations' own dtype would make."""
    mh64, v64 = mh.double(), v.double()
    exact = torch.stack(((mh64 * v64).sum(-1), (v64 * v64).sum(-1)), -1)
    scale = torch.stack((mh64.norm(dim=-1) * v64.norm(dim=-1), (v64 * v64).sum(-1)), -1)

    def error(dots: torch.Tensor) -> float:
        return ((dots.double() - exact).abs() / scale.clamp_min(1e-30)).max().item()

    native = torch.stack(((mh * v).sum(-1), (v * v).sum(-1)), -1)  # in mh.dtype
    out = {"activations": str(mh.dtype).removeprefix("torch."), "native_dtype_error": error(native)}
    for name, compiled in [("plain", False), ("fused", True)][: 1 + fused]:
        dots = family.projection_steps(compiled)[0](mh, v)  # the function the layer calls
        out[name] = {"dtype": str(dots.dtype).removeprefix("torch."), "error": error(dots)}
    # fp32 accumulation of bf16 products: ~1e-7 here; accumulating in bf16: ~1e-3
    checked = [out[k] for k in ("plain", "fused") if k in out]
    out["pass"] = all(c["dtype"] == "float32" and c["error"] < 1e-4 for c in checked)
    return out


# ---- throughput -------------------------------------------------------------------------


def throughput(bench: Bench, grid) -> None:
    known: dict[tuple, int] = {}  # (model, attention) -> micro-batch found by an earlier run
    for preset, (option, overrides), attention in itertools.product(
        bench.args.models, bench.args.options.items(), bench.args.attentions
    ):
        entry = {"model": preset, "attention": attention, "option": option, "overrides": overrides}
        bench.result["runs"].append(entry)
        if bench.out_of_time():
            entry["skipped"] = f"time limit ({bench.args.time_limit:.0f} s) reached"
            continue
        print(f"{preset} {attention} {option}:", flush=True)
        try:
            cfg_for = functools.partial(run_config, bench, preset, attention, overrides)
            entry |= measure_largest(bench, grid, cfg_for, known.get((preset, attention), 1))
            known[(preset, attention)] = entry["micro_batch"]
            print(f"  micro-batch {entry['micro_batch']}: {entry['tokens_per_s']:,.0f} tokens/s, "
                  f"{fmt(entry['peak_memory_gb'], '')} GB", flush=True)  # fmt: skip
        except Exception as err:  # recorded; the other runs go on
            bench.record_error(entry, err)
            release(None)
        add_ratios(bench.result["runs"])
        add_sequence_parallel_ratios(bench.result["runs"])
        bench.save()


def batch_overrides(micro_batch: int, accumulation: int = 1) -> list[str]:
    return [
        f"train.micro_batch_size={micro_batch}",
        f"train.global_batch_size={micro_batch * accumulation}",
        "train.global_batch_tokens=null",
    ]


def run_config(bench: Bench, preset: str, attention: str, overrides, micro_batch: int) -> Config:
    return bench.config(
        MODELS[preset], f"model.attention={attention}", *batch_overrides(micro_batch), *overrides
    )


def measure_largest(bench: Bench, grid, cfg_for, start: int) -> dict:
    """Find the largest micro-batch that fits, from `start`: double while steps fit (one
    engine), halve while they do not, then bisect between the last fit and the first miss
    to within a quarter; measure there. An engine that ran out of memory is not reused."""
    cap, device = bench.args.max_micro_batch, bench.device
    if bench.args.tensor > 1:  # every rank must take the same steps: no search
        trainee = trainee_of(cfg_for(cap), grid, device)
        result = measure(bench, trainee, cfg_for(cap), cap)
        release(trainee)
        return result
    fits = misses = trainee = None
    candidate = start
    while candidate is not None:
        try:
            if trainee is None:
                trainee = trainee_of(cfg_for(candidate), grid, device)
            step_at(trainee, cfg_for(candidate), candidate, device)
            fits = candidate
        except OOM:
            misses, trainee = candidate, release(trainee)
        candidate = next_candidate(fits, misses, cap)
    if fits is None:
        raise RuntimeError(f"micro-batch 1 does not fit in memory (searched from {start})")
    while True:  # a fragmented allocator can miss a size that fitted: step down
        try:
            trainee = trainee or trainee_of(cfg_for(fits), grid, device)
            result = measure(bench, trainee, cfg_for(fits), fits)
            release(trainee)
            return result
        except OOM:
            trainee = release(trainee)
            if fits == 1:
                raise
            fits = fits * 3 // 4


def next_candidate(fits: int | None, misses: int | None, cap: int) -> int | None:
    """The next micro-batch to try, or None when the search is done."""
    if misses is None:
        return fits * 2 if fits * 2 <= cap else None
    if fits is None:
        return misses // 2 or None
    middle = (fits + misses) // 2
    return middle if misses - fits > max(1, fits // 4) else None


def step_at(trainee, cfg: Config, micro_batch: int, device) -> None:
    """One training step at this micro-batch (the plain engine takes any batch size)."""
    timed_steps(trainee, iter(batches_for(cfg, micro_batch, seed=1, device=device)), 1, device)


def measure(bench: Bench, trainee, cfg: Config, micro_batch: int) -> dict:
    """--warmup untimed steps, then --steps timed ones; the median and the peak memory."""
    device, seq = bench.device, cfg.model.seq_length
    batches = itertools.cycle(batches_for(cfg, micro_batch, seed=2, device=device, count=2))
    accumulation = cfg.train.global_batch_size // micro_batch
    timed_steps(trainee, batches, bench.args.warmup, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, _ = timed_steps(trainee, batches, bench.args.steps, device)
    step = statistics.median(times)
    tokens_per_s = micro_batch * accumulation * seq / step
    tflops = flops_per_token(cfg.model, cfg.model.vocab_size) * tokens_per_s / 1e12
    peak = peak_tflops(device, None)
    return {
        "fused": cfg.model.compile == "projections",
        "micro_batch": micro_batch,
        "seq_length": seq,
        "step_time_s": step,
        "step_times_s": times,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_memory_gb": peak_memory_gb(device),
    }


def peak_memory_gb(device: torch.device) -> float | None:
    """The largest peak of allocated memory over the ranks (None on the CPU)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor(float(torch.cuda.max_memory_allocated(device)), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return round(peak.item() / 1e9, 2)


def add_sequence_parallel_ratios(runs: list[dict]) -> None:
    """Each sequence_parallel run's step time and peak memory relative to the
    no_sequence_parallel run of the same model and attention."""
    off = {(r["model"], r["attention"]): r for r in runs
           if r["option"] == "no_sequence_parallel" and "step_time_s" in r}  # fmt: skip
    for r in runs:
        base = off.get((r["model"], r["attention"]))
        if r["option"] != "sequence_parallel" or "step_time_s" not in r or base is None:
            continue
        r["step_time_to_no_sequence_parallel"] = r["step_time_s"] / base["step_time_s"]
        if r["peak_memory_gb"] is not None and base["peak_memory_gb"]:
            r["peak_memory_to_no_sequence_parallel"] = r["peak_memory_gb"] / base["peak_memory_gb"]


def add_ratios(runs: list[dict]) -> None:
    """Time per token relative to softmax's, same model and option set (= the step-time
    ratio when both ran the same micro-batch)."""
    base = {
        (r["model"], r["option"]): r["tokens_per_s"]
        for r in runs
        if r["attention"] == "softmax" and "tokens_per_s" in r
    }
    for r in runs:
        if "tokens_per_s" in r and (r["model"], r["option"]) in base:
            r["ratio_to_softmax"] = base[(r["model"], r["option"])] / r["tokens_per_s"]


# ---- the paper's configs ------------------------------------------------------------------


def paper_runs(bench: Bench, grid) -> None:
    args = bench.args
    for path in sorted(glob.glob("configs/paper/*.yaml")):
        entry: dict = {"config": path}
        bench.result["runs"].append(entry)
        if bench.out_of_time():
            entry["skipped"] = f"time limit ({args.time_limit:.0f} s) reached"
            continue
        print(path, flush=True)
        try:
            entry |= paper_run(bench, grid, path)
            print(f"  {entry['tokens_per_s']:,.0f} tokens/s; projected "
                  f"{entry['projection']['hours']:.1f} h on {entry['projection']['gpus']} GPUs",
                  flush=True)  # fmt: skip
        except Exception as err:
            bench.record_error(entry, err)
        bench.save()


def paper_run(bench: Bench, grid, path: str) -> dict:
    """--paper-steps of one rank's share of the config's global batch on one GPU."""
    full = load_config(path)
    gpus = full.launch.nodes * full.launch.gpus_per_node
    overrides = []
    if bench.args.smoke:  # the tiny shape, one rank's share: 2 micro-batches of 2
        overrides = [*SMOKE_SHAPE, *batch_overrides(2, 2), "train.precision=auto"]
    else:
        share = full.train.global_batch_size // gpus
        overrides = batch_overrides(
            full.train.micro_batch_size, share // full.train.micro_batch_size
        )
    cfg = load_config(path, overrides)
    micro = cfg.train.micro_batch_size
    trainee = trainee_of(cfg, grid, bench.device)
    shape = (cfg.model.vocab_size, micro, cfg.model.seq_length)
    batches = itertools.cycle(token_batches(*shape, seed=3, device=bench.device, count=2))
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
    times, losses = timed_steps(trainee, batches, bench.args.paper_steps, bench.device)
    release(trainee)
    timed = times[bench.args.warmup :] or times
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    tokens_per_s = tokens_per_step / statistics.median(timed)
    total = full.train.max_steps * full.train.global_batch_size * full.model.seq_length
    tflops = flops_per_token(cfg.model, cfg.model.vocab_size) * tokens_per_s / 1e12
    peak = peak_tflops(bench.device, None)
    return {
        "model": cfg.model.name,
        "attention": cfg.model.attention,
        "micro_batch": micro,
        "accumulation": cfg.train.global_batch_size // micro,
        "tokens_per_step": tokens_per_step,
        "steps": len(times),
        "median_over_steps": f"{bench.args.warmup + 1}-{len(times)}",
        "step_times_s": times,
        "losses": losses,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_memory_gb": round(torch.cuda.max_memory_allocated(bench.device) / 1e9, 2)
        if bench.device.type == "cuda"
        else None,
        "projection": {
            "what": "PROJECTED, not measured: the full run's tokens over this measured rate "
            "times the run's GPUs (perfect data-parallel scaling; no communication, data "
            "loading, evaluation or checkpoint time)"
            + (" -- smoke: a tiny model's rate, meaningless" if bench.args.smoke else ""),
            "gpus": gpus,
            "full_run_tokens": total,
            "hours": total / (tokens_per_s * gpus) / 3600,
        },
    }


# ---- belief-lm's step against a plain PyTorch loop ----------------------------------------


def overhead_runs(bench: Bench, grid) -> None:
    """bench/step_overhead.py's side-by-side steps in bf16 for each model and attention."""
    from bench.step_overhead import comparison_config, side_by_side

    args = bench.args
    micro_batch = args.overhead_micro_batch
    for preset, attention in itertools.product(args.models, args.attentions):
        entry = {"model": preset, "attention": attention, "precision": "bf16"}
        entry["micro_batch"] = micro_batch
        bench.result["runs"].append(entry)
        if bench.out_of_time():
            entry["skipped"] = f"time limit ({args.time_limit:.0f} s) reached"
            continue
        try:
            shape = SMOKE_SHAPE if args.smoke else []
            cfg = comparison_config(MODELS[preset], shape, attention, "bf16", micro_batch)
            entry |= side_by_side(cfg, grid, bench.device, args.warmup, args.steps, args.profile)
            print(f"{preset} {attention}: plain {entry['plain']['median_step_s']:.4f} s, "
                  f"belief-lm {entry['belief_lm']['median_step_s']:.4f} s, "
                  f"x{entry['ratio']:.3f}", flush=True)  # fmt: skip
        except Exception as err:
            bench.record_error(entry, err)
            release(None)
        bench.save()


# ---- report -----------------------------------------------------------------------------


def markdown_table(result: dict) -> str:
    """The README's table: one row per run."""
    if any("ratio" in r for r in result["runs"]):
        head = "| model | attention | micro-batch | plain PyTorch s | belief-lm s | ratio |"
        rows = [
            f"| {r['model']} | {r['attention']} | {r['micro_batch']} | "
            f"{r['plain']['median_step_s']:.4f} | {r['belief_lm']['median_step_s']:.4f} | "
            f"{r['ratio']:.3f} |"
            for r in result["runs"]
            if "ratio" in r
        ]
    elif any("config" in r for r in result["runs"]):
        head = "| config | tokens/s (1 GPU) | TFLOP/s | MFU | peak memory GB | projected hours |"
        rows = [
            f"| {r['config']} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
            f"{fmt(r['mfu'])} | {fmt(r['peak_memory_gb'], '')} | {r['projection']['hours']:.1f} "
            f"on {r['projection']['gpus']} |"
            for r in result["runs"]
            if "tokens_per_s" in r
        ]
    else:
        head = (
            "| model | attention | option | micro-batch | tokens/s | TFLOP/s | MFU | "
            "peak memory GB | x softmax |"
        )
        rows = [
            f"| {r['model']} | {r['attention']} | {r['option']} | {r['micro_batch']} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops']:.2f} | {fmt(r['mfu'])} | "
            f"{fmt(r['peak_memory_gb'], '')} | {fmt(r.get('ratio_to_softmax'), '.3f')} |"
            for r in result["runs"]
            if "tokens_per_s" in r
        ]
    separator = "|" + "---|" * head.count(" | ") + "---|"
    return "\n".join([head, separator, *rows])


def fmt(value, spec: str = ".1%") -> str:
    """`value` formatted, or "-" where it was not measured (None: MFU and GPU memory on CPU)."""
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
