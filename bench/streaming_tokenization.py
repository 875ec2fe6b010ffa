"""Streaming pipeline throughput against raw sentencepiece encoding of the same text.

    python bench/streaming_tokenization.py   # -> bench/results/streaming_tokenization_cpu.json

Writes a FineWeb-Edu-schema parquet corpus (the embedded corpus's documents joined into
~--doc-chars documents, --copies times with distinct ids), then measures
  raw:      tokens/s of Tokenizer.encode_batch (one thread, EOS added, batches of the
            pipeline's read size) over the corpus's texts, already in memory;
  pipeline: tokens/s of build_train_data's steps (parquet read, row parsing,
            tokenization in DataLoader workers, packing, batching) with 1 and 2 workers
            (and 0: all in this process), after the first step (start-up is separate),
            per second of wall time and per second of the workers' CPU time;
and the largest resident memory of a worker while streaming a 1x and a 16x corpus. The
machine may be shared: each round measures raw, 1 worker and 2 workers back to back, ratios
are taken within a round, and the medians over --repeats rounds are reported. Last, with
--train-steps N: the real `belief-lm train` of configs/tiny.yaml on the corpus with 1 and 2
loader workers, and the share of its step time spent waiting for data (metrics.jsonl's
data_wait_s over step_time_s, the first logged interval, which holds the start-up, left out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # a dependency of deepspeed: always installed beside it
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from belief_lm.report import read_jsonl
from bench.common import write_result
from data_pipeline.build import build_tokenizer, build_train_data
from data_pipeline.config import DataConfig
from data_pipeline.embedded import embedded_documents
from data_pipeline.stream import READ_BATCH


def corpus_texts(doc_chars: int) -> list[str]:
    """The embedded corpus's documents joined in order into documents of ~doc_chars."""
    texts, current = [], ""
    for doc in embedded_documents():
        current = f"{current}\n\n{doc.text}" if current else doc.text
        if len(current) >= doc_chars:
            texts.append(current)
            current = ""
    return texts


def write_corpus(folder: Path, texts: list[str], copies: int, files: int = 8) -> None:
    rows = [
        {"text": text, "id": f"<urn:uuid:{c}-{i}>", "int_score": 3}
        for c in range(copies)
        for i, text in enumerate(texts)
    ]
    per_file = -(-len(rows) // files)
    for f in range(files):
        part = pa.Table.from_pylist(rows[f * per_file : (f + 1) * per_file])
        pq.write_table(part, folder / f"{f:03d}_00000.parquet", row_group_size=1000)


def raw_run(tokenizer, texts: list[str]) -> dict:
    """Tokens per second of wall time and of this process's CPU time."""
    start, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for i in range(0, len(texts), READ_BATCH):
        ids = tokenizer.encode_batch(texts[i : i + READ_BATCH], add_eos=True, num_threads=1)
        tokens += sum(map(len, ids))
    return {
        "tokens_per_s": tokens / (time.perf_counter() - start),
        "tokens_per_cpu_s": tokens / (time.process_time() - cpu),
    }


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)  # user + system


def pipeline_run(data: DataConfig, tokenizer, tokens: int, seq_len: int, batch: int) -> dict:
    """Stream about `tokens` tokens: throughput after the first batch, per second of wall
    time and per second of the workers' CPU time; the workers' largest memory."""
    start = time.perf_counter()
    steps = build_train_data(data, tokenizer, seq_len, batch, batch, 0, 1, torch.device("cpu"))
    steps.next_step()
    first = time.perf_counter()
    workers = psutil.Process().children() or [psutil.Process()]  # none: all in this process
    cpu = _cpu_seconds(workers)
    n = max(2, tokens // (batch * (seq_len + 1)))
    rss = 0
    for i in range(n - 1):
        steps.next_step()
        if i % 10 == 0:
            rss = max([rss, *(w.memory_info().rss for w in workers)])
    wall, cpu = time.perf_counter() - first, _cpu_seconds(workers) - cpu
    steps.close()  # (the workers exit: their CPU time is read before)
    streamed = (n - 1) * batch * (seq_len + 1)
    return {
        "startup_s": first - start,
        "tokens_per_s": streamed / wall,
        "tokens_per_cpu_s": streamed / cpu,
        "max_worker_rss_mb": rss / 2**20,
    }


def training_run(corpus: Path, workers: int, steps: int, cache_dir: str, out: Path) -> dict:
    """The data wait of `belief-lm train` (configs/tiny.yaml, `steps` steps) on the corpus."""
    source = f"[{{uri: '{corpus}/*.parquet', id_column: id}}]"
    command = [sys.executable, "-m", "belief_lm.cli", "train", "--config", "configs/tiny.yaml",
               f"data.sources={source}", f"data.num_workers={workers}", f"train.max_steps={steps}",
               "run.tensorboard=false", f"run.output_dir={out}",
               f"run.cache_dir={cache_dir}"]  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    subprocess.run(command, cwd=root, check=True, capture_output=True, timeout=1800)
    rows = read_jsonl(out / "metrics.jsonl")
    rows = [r for r in rows if "data_wait_s" in r][1:]  # past the start-up's interval
    wait, step = sum(r["data_wait_s"] for r in rows), sum(r["step_time_s"] for r in rows)
    return {"workers": workers, "steps": steps, "data_wait_s_per_step": wait / len(rows),
            "step_time_s": step / len(rows), "data_wait_share": wait / step}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doc-chars", type=int, default=4000)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=100, help="0: no training runs")
    parser.add_argument("--cache-dir", default="~/.cache/belief-lm")
    parser.add_argument("--out", default="bench/results/streaming_tokenization_cpu.json")
    args = parser.parse_args()

    tokenizer = build_tokenizer(DataConfig(), args.cache_dir)  # the default 4096-piece model
    texts = corpus_texts(args.doc_chars)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {}
        for copies in sorted({1, args.copies, 4 * args.copies}):
            folder = Path(tmp) / f"x{copies}"
            folder.mkdir()
            write_corpus(folder, texts, copies)
            corpora[copies] = folder

        def data(copies: int, workers: int) -> DataConfig:
            return DataConfig(
                sources=[{"uri": f"{corpora[copies]}/*.parquet", "id_column": "id"}],
                num_workers=workers,
                validation_fraction=0.0,
            )

        all_texts = texts * args.copies
        total = sum(map(len, tokenizer.encode_batch(all_texts, add_eos=True)))
        budget = int(0.9 * total)  # stay inside one epoch
        raw, runs = [], {0: [], 1: [], 2: []}
        for _ in range(args.repeats):
            fresh = [t.encode().decode() for t in all_texts]  # new str objects, as read
            raw.append(raw_run(tokenizer, fresh))
            for w, results in runs.items():
                config = data(args.copies, w)
                run = pipeline_run(config, tokenizer, budget, args.seq_len, args.batch)
                run["vs_raw"] = run["tokens_per_s"] / max(w, 1) / raw[-1]["tokens_per_s"]
                run["cpu_vs_raw"] = run["tokens_per_cpu_s"] / raw[-1]["tokens_per_cpu_s"]
                results.append(run)
        training = [
            training_run(
                corpora[args.copies], w, args.train_steps, args.cache_dir, Path(tmp) / f"run{w}"
            )
            for w in ((1, 2) if args.train_steps else ())
        ]
        for run in training:
            share = 100 * run["data_wait_share"]
            print(f"training, {run['workers']} worker(s): data wait {share:.2f}% of the step "
                  f"({run['step_time_s']:.3f} s)")  # fmt: skip
        memory = {
            f"{c}x": pipeline_run(
                data(c, 1), tokenizer, int(0.9 * total * c / args.copies), args.seq_len, args.batch
            )["max_worker_rss_mb"]
            for c in (1, 4 * args.copies)
        }

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    rows = {}
    for w, results in runs.items():
        rows[f"{w}_workers"] = {
            key: median(results, key)
            for key in ("tokens_per_s", "tokens_per_cpu_s", "vs_raw", "cpu_vs_raw", "startup_s")
        }
        rows[f"{w}_workers"]["runs"] = results
        print(
            f"{w} worker(s): {rows[f'{w}_workers']['tokens_per_s']:,.0f} tokens/s; per worker "
            f"{rows[f'{w}_workers']['vs_raw']:.3f} x raw (wall), "
            f"{rows[f'{w}_workers']['cpu_vs_raw']:.3f} x raw (CPU time)"
        )
    print(f"raw sentencepiece: {median(raw, 'tokens_per_s'):,.0f} tokens/s; worker RSS {memory}")
    result = {
        "benchmark": "streaming tokens/s (parquet -> micro-batches) vs raw sentencepiece",
        "corpus": {
            "documents": len(all_texts),
            "characters": sum(map(len, all_texts)),
            "tokens": total,
            "doc_chars": args.doc_chars,
            "schema": "FineWeb-Edu columns text, id, int_score; 8 files, row groups of 1000 rows",
        },
        "tokenizer_vocab": tokenizer.vocab_size,
        "seq_len": args.seq_len,
        "micro_batch": args.batch,
        "raw": {
            "tokens_per_s": median(raw, "tokens_per_s"),
            "tokens_per_cpu_s": median(raw, "tokens_per_cpu_s"),
            "runs": raw,
        },
        "pipeline": rows,
        "max_worker_rss_mb_by_corpus_copies": memory,
        "training": training,
        "cpu_cores": os.cpu_count(),
        "load_average_before_after": [load_before, os.getloadavg()],
    }
    print("wrote", write_result(args.out, result, torch.device("cpu")))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
