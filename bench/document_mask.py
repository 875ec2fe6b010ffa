"""Step time under model.attention_mask=document against causal, on real documents.

    python bench/document_mask.py                  # tiny at sequence 1024 on the CPU
    python bench/document_mask.py --kernels        # and the attention kernels alone
    python bench/document_mask.py --device cuda --dtype bf16 --batch 16 \
        --config configs/paper/gpt2-124m-owt.yaml data.sources=[embedded]

The windows are the embedded corpus's documents as the data pipeline packs them (each
ended by an EOS, windows cut across them: about 5 documents per 1,024 tokens). Per
variant, two engines from the same seed, built as training builds them (DeepSpeed, the
project's AdamW: bench.common.bench_engine), one causal and one document-masked, take
training steps in turns on the same batches, so a slow spell of a shared machine hits
both alike; the median step time of each and their ratio. The load average is recorded
before and after.

--kernels: the attention alone, forward and backward, at the model's shape on the same
windows' documents: causal SDPA (the baseline) and the candidates for the CPU path, each
checked against the dense mask first: attention.DOCUMENT_KERNELS' bins (what the CPU runs)
and dense, and a loop of causal SDPA over every document of every row.

Every time is taken twice: wall-clock, and this process's CPU time (time.process_time),
which another process's load disturbs less (a shared machine's numbers say so).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from belief_lm import attention as family
from belief_lm.config import load_config, padded_vocab_size
from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.env import detect
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.runtime import select_device
from belief_lm.variants import VARIANTS
from bench.common import bench_trainee, write_result
from data_pipeline.build import build_tokenizer, build_validation_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml", help="model and data")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--variants", nargs="+", default=["softmax", "attention_bn_sh"],
                        choices=list(VARIANTS))  # fmt: skip
    parser.add_argument("--batches", type=int, default=6, help="distinct batches, cycled")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each engine")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--kernels", action="store_true", help="the attention kernels alone")
    parser.add_argument("--kernel-repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides (section.key=value)")
    args = parser.parse_args()

    device = select_device(args.device)
    grid = ProcessGrid.join(detect(), device, ParallelDims(1, 1, 1))
    overrides = [
        f"model.seq_length={args.seq}", f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}", "train.global_batch_tokens=null",
        f"train.precision={args.dtype}",
    ]  # fmt: skip
    cfg = load_config(args.config, [*overrides, *args.overrides])
    tokenizer = build_tokenizer(cfg.data, cfg.run.cache_dir)
    vocab = padded_vocab_size(tokenizer.vocab_size, cfg.model, 1)
    every_document = cfg.data.model_copy(update={"validation_fraction": 1.0})  # as evaluate
    corpus = build_validation_data(every_document, tokenizer, args.seq, args.batch, device, 10**6)
    batches = corpus[:: max(1, len(corpus) // args.batches)][: args.batches]  # spread over it
    ends = torch.stack([tokens for tokens, _ in batches]) == tokenizer.eos_id
    documents = round(float(ends.sum(-1).float().mean()) + 1, 2)
    print(f"{len(batches)} of the corpus's {len(corpus)} batches of {args.batch} x {args.seq} "
          f"tokens; {documents} documents per window (mean)", flush=True)  # fmt: skip
    result = {
        "benchmark": "training step time, model.attention_mask document against causal",
        "model": cfg.model.model_dump(mode="json"),
        "config": args.config, "overrides": args.overrides, "batch": args.batch,
        "seq_length": args.seq, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "documents_per_window": documents,
        "document_kernel": family.document_kernel(device), "load_before": os.getloadavg(),
    }  # fmt: skip
    if args.kernels:
        result["kernels"] = kernels(cfg.model, batches, tokenizer.eos_id, device, args)
    result["variants"] = {}
    for variant in args.variants if args.steps else []:
        result["variants"][variant] = step_times(
            cfg, variant, batches, vocab, tokenizer.eos_id, grid, device, args
        )
    result["load_after"] = os.getloadavg()
    suffix = f"_{args.device}" + ("" if args.dtype == "fp32" else f"_{args.dtype}")
    out = args.out or f"bench/results/document_mask{suffix}.json"
    print("wrote", write_result(out, result, device))


def step_times(cfg, variant, batches, vocab, eos_id, grid, device, args) -> dict:
    """Both masks' engines stepping in turns: the median step time of each, the ratio."""
    engines = {}
    for mask in ("causal", "document"):
        run = cfg.model_copy(deep=True)
        run.model = cfg.model.model_copy(update={"attention": variant, "attention_mask": mask})
        engines[mask] = bench_trainee(run, grid, vocab, device, eos_id=eos_id)
    times: dict[str, list[tuple[float, float]]] = {mask: [] for mask in engines}
    losses: dict[str, list[float]] = {mask: [] for mask in engines}
    cycle = itertools.cycle(batches)
    for step in range(args.warmup + args.steps):
        batch = next(cycle)
        for mask, trainee in engines.items():  # the same batch for both, back to back
            step_loss = functools.partial(one_step, trainee, batch, losses[mask])
            took = timed(step_loss, device)
            if step >= args.warmup:
                times[mask].append(took)
    row = summary(times, "causal")
    for mask in row:
        row[mask]["losses"] = losses[mask]
    document = row["document"]
    print(f"{variant:16s} causal {row['causal']['median_ms']:.0f} ms, document "
          f"{document['median_ms']:.0f} ms: x{document['ratio']:.3f} (CPU time "
          f"x{document['cpu_ratio']:.3f})", flush=True)  # fmt: skip
    for trainee in engines.values():
        trainee.engine.destroy()
    return row


def kernels(model, batches, eos_id: int, device, args) -> dict:
    """The candidates for document-masked softmax, forward and backward, at the model's
    heads and head width on the windows' documents; each equal to the dense mask first."""
    tokens = torch.cat([t for t, _ in batches])[: args.batch]
    docs = family.documents(tokens == eos_id)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, model.num_attention_heads, args.seq, model.head_dim)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
               for _ in range(3))  # fmt: skip
    softmax = family.document_softmax
    candidates = {
        "causal (baseline)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "bins": lambda: family.documents_in_bins(q, k, v, "softmax", 1.0, 1, None, docs),
        "dense": lambda: softmax(q, k, v, docs.starts, None, None, "dense"),
        "loop over documents": lambda: loop_over_documents(q, k, v, docs.starts),
    }
    reference = candidates["dense"]().detach()
    for name, fn in candidates.items():
        if name != "causal (baseline)":
            torch.testing.assert_close(fn().detach(), reference, rtol=1e-4, atol=1e-4)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in candidates}
    for _ in range(args.kernel_repeats):  # in turns, as the steps
        for name, fn in candidates.items():
            times[name].append(timed(lambda fn=fn: fn().sum().backward(), device))
            q.grad = k.grad = v.grad = None
    out = summary(times, "causal (baseline)")
    for name, row in out.items():
        print(f"  {name:20s} {row['median_ms']:9.1f} ms  x{row['ratio']:.2f}  (CPU time "
              f"{row['cpu_median_ms']:9.1f} ms  x{row['cpu_ratio']:.2f})", flush=True)  # fmt: skip
    return out


def one_step(trainee, batch, losses: list[float]) -> None:
    """A training step on `batch`; its loss appended (.item(): a host sync, the step done)."""
    losses.append(trainee.train_step(iter([batch])).loss.item())


def timed(work, device) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of work()."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def summary(times: dict[str, list[tuple[float, float]]], base: str) -> dict:
    """Per name: the medians of wall and CPU time (ms), their ratios to `base`'s, samples."""
    medians = {name: [statistics.median(x) for x in zip(*samples, strict=True)]
               for name, samples in times.items()}  # fmt: skip
    (wall0, cpu0) = medians[base]
    return {
        name: {"median_ms": wall * 1e3, "ratio": wall / wall0, "cpu_median_ms": cpu * 1e3,
               "cpu_ratio": cpu / cpu0, "times_ms": [t * 1e3 for t, _ in times[name]],
               "cpu_times_ms": [c * 1e3 for _, c in times[name]]}
        for name, (wall, cpu) in medians.items()
    }  # fmt: skip


def loop_over_documents(q, k, v, starts) -> torch.Tensor:
    """Causal SDPA on each document of each row, the rows' tokens flattened and split."""
    b, heads, s, d = q.shape
    begins = starts == torch.arange(s)
    lengths = torch.diff(torch.nonzero(begins.flatten()).flatten(), append=torch.tensor([b * s]))
    flat = [x.transpose(1, 2).reshape(b * s, heads, d).split(lengths.tolist()) for x in (q, k, v)]
    parts = [F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in xs),
                                            is_causal=True)[0].transpose(0, 1)
             for xs in zip(*flat, strict=True)]  # fmt: skip
    return torch.cat(parts).view(b, s, heads, d).transpose(1, 2)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
