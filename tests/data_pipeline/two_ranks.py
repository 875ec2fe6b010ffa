"""One rank of the two-rank resume test, started by torchrun: the trainer's data calls on
FineWeb-Edu-schema parquet (check_data, build_tokenizer, build_train_data).

    torchrun --standalone --nproc-per-node 2 two_ranks.py OUT first  [section.key=value ...]
        12 micro-batches uninterrupted (OUT/full<r>.pt); then a fresh stream stops after 5
        (OUT/first<r>.pt) and saves its data state (OUT/state<r>.pt), and the process exits
    torchrun --standalone --nproc-per-node 2 two_ranks.py OUT resume [section.key=value ...]
        a new process loads the state and reads 7 more (OUT/resumed<r>.pt)
"""

import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from belief_lm.config import load_config
from belief_lm.parallel import env as process_env
from belief_lm.parallel.collectives import rank_zero_first
from belief_lm.parallel.setup import init_distributed, init_model_parallel
from data_pipeline.build import build_tokenizer, build_train_data, check_data


def main(out: str, phase: str, *overrides: str) -> None:
    cfg = load_config(None, list(overrides))
    device = torch.device("cpu")
    check_data(cfg.data)  # as the trainer's pre-flight, before any process group
    init_distributed(process_env.detect(), device)
    layout = init_model_parallel(1, 1)
    # rank 0 trains the tokenizer, the others wait and load it from the cache
    tokenizer = rank_zero_first(lambda: build_tokenizer(cfg.data, cfg.run.cache_dir))

    def stream():
        return build_train_data(
            cfg.data,
            tokenizer,
            cfg.model.seq_length,
            cfg.train.micro_batch_size,
            layout.data_rank,
            layout.data,
            device,
        )

    def save(batches, steps: int, name: str) -> None:
        windows = [torch.cat([x, y[:, -1:]], 1) for x, y in itertools.islice(batches, steps)]
        torch.save(windows, Path(out) / f"{name}{dist.get_rank()}.pt")

    state_file = Path(out) / f"state{dist.get_rank()}.pt"
    if phase == "first":
        save(stream(), 12, "full")
        first = stream()
        save(first, 5, "first")
        torch.save(first.state_dict(), state_file)
    else:
        resumed = stream()
        resumed.load_state_dict(torch.load(state_file, weights_only=True))
        save(resumed, 7, "resumed")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
