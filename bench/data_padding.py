"""What exact epochs cost on realistic document lengths: padding, tokens read twice, and
how many documents feed each step, epochs' turns included.

    python bench/data_padding.py      # -> bench/results/data_padding_cpu.json

Each case from the start until epoch 2's units are being dealt (two turns), on 8
data-parallel ranks (4 at 4 readers) without loader workers, with data.open_documents=8
(the default; the last cases again with 1, one document after another, for comparison):
  heavy-tailed  FineWeb-Edu-schema parquet of real prose with lognormal lengths (median 600
                characters, sigma 1) and 3 documents of 40,000 characters (each longer than
                one reader's share at 64 readers and more): 6,000 documents at 4, 16, 64
                and 256 readers, and 1,500 at 128 (units of one or two documents);
  embedded      README command 1's data: the embedded corpus, 16 readers of 128 tokens;
  source files  600 of Python's own standard-library modules as JSON lines (3 files): real
                lengths with a long tail (median 7 KB, the longest 229 KB, several times a
                unit's bytes at 64 readers), 64 readers of 32 tokens;
  long          bench/stream_vs_prepared.py's corpus of long documents (250 of prose,
                lognormal around 4,500 characters: median about 9 windows of 128 tokens),
                16 readers of 128 tokens.
For each: the steps, the step at which epoch 1's units began to be dealt (the turn) and the
first step after which every document of epoch 0 was read whole (a document longer than a
reader's share of an epoch is read on into the next ones), the padding (label slots without
a token), the slots without any token, the tokens sentencepiece encoded per token delivered
in a window, the documents with a token in a step (mean, least, and the mean and least over
the ten steps around each turn) and the share of a reader's windows that hold a token of
the document its previous window held (repeats).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data_pipeline"))

import torch

from bench.common import write_result
from bench.data_scale import TimedTokenizer

RANKS = 8
"""Data-parallel ranks: readers that share a stream read it once per rank."""
HEAVY = [(4, 128), (16, 64), (64, 32), (256, 32)]
"""(readers, seq_len) of the heavy-tailed cases: one window per reader a step."""
FEW_PER_READER = (1500, 128, 32)
"""(documents, readers, seq_len): the heavy-tailed corpus with about 12 documents per
reader, so that most units hold one or two documents."""


class CountingTokenizer(TimedTokenizer):
    """A tokenizer that also counts the tokens its encode_batch returns."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.tokens = 0

    def encode_batch(self, *args, **kwargs):
        ids = super().encode_batch(*args, **kwargs)
        self.tokens += sum(len(x) for x in ids)
        return ids


def two_turns(data, tokenizer, readers: int, seq_len: int) -> dict:
    """Steps until epoch 2's units are being dealt, on RANKS data-parallel ranks (threads
    of this process, agreeing as the trainer's ranks do), each reading its readers' streams
    itself; one window per reader a step."""
    from ranks import Ranks  # the tests' ranks in threads

    counting = CountingTokenizer(tokenizer)
    ranks = Ranks(min(RANKS, readers))
    trains = ranks.build(data, counting, seq_len, readers, readers)
    deal = trains[0].schedule.deals[0]
    steps, labels, empty, turns, whole, started = 0, 0, 0, [], None, time.perf_counter()
    while deal.epoch < 2:
        epoch = deal.epoch
        for window in ranks.steps(trains, 1)[0]:
            labels += max(len(window) - 1, 0)
            empty += not window
        steps += 1
        turns += [steps] * (deal.epoch - epoch)
        whole = whole or (steps if deal.oldest_epoch() > 0 else None)
    slots = steps * readers
    return {
        "readers": readers,
        "seq_len": seq_len,
        "open_documents": data.open_documents,
        "steps": steps,
        "turns": turns,
        "epoch_0_whole_at": whole,
        "padding_pct": round(100 * (1 - labels / (slots * seq_len)), 3),
        "empty_slots_pct": round(100 * empty / slots, 3),
        # a window of n tokens trains n - 1 labels
        "encoded_per_delivered_token": round(counting.tokens / (labels + slots - empty), 4),
        **diversity(ranks.origins, turns),
        "seconds": round(time.perf_counter() - started, 1),
    }


def diversity(origins: list, turns: list[int]) -> dict:
    """Documents per step and repeats (see the module docstring), from the windows'
    origins; `turns`: the steps at which an epoch's dealing began."""
    from corpora import around_turns, documents_per_step, repeats

    per_step = documents_per_step(origins)
    around = around_turns(per_step, turns)
    windows = sum(bool(origin[5]) for step in origins[1:] for origin in step)
    return {
        "documents_per_step": round(sum(per_step) / len(per_step), 2),
        "documents_per_step_min": min(per_step),
        "turn_documents_per_step": round(sum(around) / len(around), 2),
        "turn_documents_per_step_min": min(around),
        "repeats_pct": round(100 * sum(repeats(origins)) / max(windows, 1), 2),
    }


def write_source_files(root: Path, count: int) -> None:
    """`count` modules of this Python's standard library (a seeded choice), as JSON lines in
    3 files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    texts = []
    for path in paths:
        with contextlib.suppress(UnicodeDecodeError, OSError):
            if text := path.read_text(encoding="utf-8").strip():
                texts.append(text)
    random.Random(1).shuffle(texts)
    for f in range(3):
        with open(root / f"{f}.jsonl", "w") as out:
            out.writelines(json.dumps({"text": t}) + "\n" for t in texts[f:count:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/data_padding_cpu.json")
    parser.add_argument("--documents", type=int, default=6000)
    args = parser.parse_args()
    from corpora import heavy_tailed_rows, long_document_rows, write_parquet

    from data_pipeline.build import build_tokenizer
    from data_pipeline.config import DataConfig

    tokenizer = build_tokenizer(DataConfig(), "~/.cache/belief-lm")
    cases = []
    heavy = [(args.documents, readers, seq_len) for readers, seq_len in HEAVY]
    for documents, readers, seq_len in [*heavy, FEW_PER_READER]:
        with tempfile.TemporaryDirectory() as tmp:
            rows = heavy_tailed_rows(documents, 600, 3, 40_000)
            for f in range(4):
                part = rows[f * len(rows) // 4 : (f + 1) * len(rows) // 4]
                write_parquet(Path(tmp) / f"{f:03d}.parquet", part, 100)
            data = DataConfig(
                sources=[{"uri": f"{tmp}/*.parquet", "id_column": "id"}], readers=readers,
                num_workers=0, validation_fraction=0.05, seed=11,
            )  # fmt: skip
            case = two_turns(data, tokenizer, readers, seq_len)
            cases.append({"corpus": "heavy-tailed", "documents": documents, **case})
            print(cases[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_source_files(Path(tmp), 600)
        data = DataConfig(
            sources=[f"{tmp}/*.jsonl"], readers=64, num_workers=0, validation_fraction=0.05,
            seed=11,
        )  # fmt: skip
        cases.append({"corpus": "source files", **two_turns(data, tokenizer, 64, 32)})
        print(cases[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = long_document_rows(250, 4500)
        for f in range(4):
            write_parquet(Path(tmp) / f"{f:03d}.parquet", rows[f::4], 16)
        long = DataConfig(
            sources=[{"uri": f"{tmp}/*.parquet", "id_column": "id"}], num_workers=0,
            validation_fraction=0.1,
        )  # fmt: skip
        for lanes in (8, 1):  # (1: one document after another, for comparison)
            for name, data in (("embedded", DataConfig(num_workers=0)), ("long", long)):
                data = data.model_copy(update={"open_documents": lanes})
                cases.append({"corpus": name, **two_turns(data, tokenizer, 16, 128)})
                print(cases[-1], flush=True)
    result = {"documents": args.documents, "cases": cases}
    print(write_result(args.out, result, torch.device("cpu")))


if __name__ == "__main__":
    main()
