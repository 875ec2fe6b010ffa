"""What the data pipeline's start-up and schedule cost as readers and files grow.

    python bench/data_scale.py        # -> bench/results/data_scale_cpu.json
    python bench/data_scale.py --open-documents 8 1   # and each case with one lane, in turn

For 64, 512 and 2,048 logical readers over 100 and 2,000 FineWeb-Edu-schema parquet files
(40 rows each, lognormal lengths around 600 characters), each case in a process of its own
with the streams in that process (as one loader worker has them), seq_len 128 and one
window per reader a step:
  check_s       the pre-flight (check_data: every file's footer and a first document);
  build_s       build_train_data (footers, units, the schedule's first deal);
  first_step_s  the first step (every stream opens its first unit), and tokenize_s, the
                part of it spent in sentencepiece; overhead_s = check + build + first
                step - tokenize: the start-up a worker pays beyond tokenizing (target: at
                most 5 s at 2,048 readers x 2,000 files);
  resume_s      a fresh TrainData that loads the state saved after 3 steps, and its first
                step (tokenizing excluded, as overhead_s);
  step_s        a later step (the median of 5), tokenizing included;
  epoch_turn_s  a new epoch's order (its units are then dealt as the streams need them, as
                any others: epochs overlap at the turn);
  peak_rss_mb   the process's largest resident memory; state_kb, the data state's size;
                report_kb, the integers summed over the ranks each step (positions and
                counts), as int64.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bench.common import write_result

READERS = (64, 512, 2048)
FILES = (100, 2000)
ROWS_PER_FILE = 40
SEQ_LEN = 128


def write_corpus(folder: Path, files: int) -> None:
    """`files` parquet files of ROWS_PER_FILE rows of real prose, lognormal lengths."""
    from data_pipeline.embedded import embedded_documents
    from tests.data_pipeline.corpora import FINEWEB_SCHEMA, fineweb_rows

    folder.mkdir(parents=True, exist_ok=True)
    prose = "\n\n".join(doc.text for doc in embedded_documents())
    rng, base = np.random.default_rng(0), fineweb_rows(1)[0]
    for f in range(files):
        lengths = np.maximum(rng.lognormal(np.log(600), 1.0, ROWS_PER_FILE), 20).astype(int)
        starts = rng.integers(0, len(prose) - lengths)
        rows = [
            {**base, "id": f"{f}-{i}", "text": prose[start : start + n]}
            for i, (start, n) in enumerate(zip(starts, lengths, strict=True))
        ]
        table = pa.Table.from_pylist(rows, schema=FINEWEB_SCHEMA)
        pq.write_table(table, folder / f"{f:05d}.parquet")


class TimedTokenizer:
    """A tokenizer that adds up the seconds its encode_batch takes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seconds = tokenizer, 0.0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode_batch(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.tokenizer.encode_batch(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def measure(folder: Path, readers: int, cache: str, open_documents: int) -> dict:
    """One case, in this process (see the module docstring)."""
    from data_pipeline.build import build_tokenizer, build_train_data, check_data
    from data_pipeline.config import DataConfig
    from data_pipeline.loader import report_length
    from data_pipeline.stream import epoch_order

    data = DataConfig(
        sources=[{"uri": f"{folder}/*.parquet", "id_column": "id"}], readers=readers,
        num_workers=0, open_documents=open_documents,
    )  # fmt: skip
    tokenizer = TimedTokenizer(build_tokenizer(DataConfig(), cache))
    cpu = torch.device("cpu")

    def build():
        return build_train_data(data, tokenizer, SEQ_LEN, readers, readers, 0, 1, cpu)

    started = time.perf_counter()
    check_data(data)
    check = time.perf_counter() - started
    started = time.perf_counter()
    train = build()
    built = time.perf_counter() - started
    tokenizer.seconds, started = 0.0, time.perf_counter()
    train.next_step()
    first, tokenize = time.perf_counter() - started, tokenizer.seconds
    train.next_step()
    train.next_step()
    steps = []
    for _ in range(5):
        started = time.perf_counter()
        train.next_step()
        steps.append(time.perf_counter() - started)
    state = train.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    resumed = build()
    tokenizer.seconds, started = 0.0, time.perf_counter()
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    resumed.next_step()
    resume = time.perf_counter() - started - tokenizer.seconds
    deal = train.schedule.deals[0]
    started = time.perf_counter()
    epoch_order(len(deal.sizes), data.seed, deal.epoch + 1)  # then dealt as streams need units
    turn = time.perf_counter() - started
    return {
        "readers": readers,
        "files": len(list(folder.glob("*.parquet"))),
        "units": len(deal.sizes),
        "check_s": round(check, 3),
        "build_s": round(built, 3),
        "first_step_s": round(first, 3),
        "tokenize_s": round(tokenize, 3),
        "overhead_s": round(check + built + first - tokenize, 3),
        "resume_s": round(resume, 3),
        "step_s": round(statistics.median(steps), 3),
        "epoch_turn_s": round(turn, 4),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "state_kb": round(len(buffer.getvalue()) / 1024, 1),
        "report_kb": round(report_length(train.schedule) * 8 / 1024, 1),
        "open_documents": data.open_documents,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/data_scale_cpu.json")
    parser.add_argument("--readers", type=int, nargs="+", default=list(READERS))
    parser.add_argument("--files", type=int, nargs="+", default=list(FILES))
    parser.add_argument(
        "--open-documents", type=int, nargs="+", default=[8],
        help="data.open_documents of each case (several: each case once per value, in turn)",
    )  # fmt: skip
    parser.add_argument("--case", nargs=4, help=argparse.SUPPRESS)  # FOLDER READERS CACHE LANES
    args = parser.parse_args()
    if args.case:
        folder, readers, cache, lanes = args.case
        print(json.dumps(measure(Path(folder), int(readers), cache, int(lanes))))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for files in args.files:
            folder = Path(tmp) / f"files{files}"
            write_corpus(folder, files)
            for readers in args.readers:
                for lanes in args.open_documents:
                    case = [sys.executable, __file__, "--case", str(folder), str(readers)]
                    done = subprocess.run(
                        [*case, str(Path(tmp) / "cache"), str(lanes)], capture_output=True,
                        text=True, check=True,
                    )  # fmt: skip
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(rows[-1], flush=True)
    result = {"seq_len": SEQ_LEN, "rows_per_file": ROWS_PER_FILE, "cases": rows}
    print(write_result(args.out, result, torch.device("cpu")))


if __name__ == "__main__":
    main()
