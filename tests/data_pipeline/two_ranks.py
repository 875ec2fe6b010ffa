"""One rank of the data resume test, started by torchrun: the trainer's data calls on
FineWeb-Edu-schema parquet (check_data, build_tokenizer, build_train_data), the trainer's
per-step agreement between ranks, real DataLoader workers.

    torchrun --standalone --nproc-per-node N two_ranks.py OUT first [section.key=value ...]
        12 steps uninterrupted (OUT/full.pt: the global batches); then a fresh stream stops
        after 5 (OUT/first.pt) and saves the merged data state of all ranks (OUT/state.pt)
    torchrun --standalone --nproc-per-node M two_ranks.py OUT resume [section.key=value ...]
        new processes load the state and take 7 more steps (OUT/resumed-M.pt)
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from corpora import states_equal, step_windows

from belief_lm.config import load_config
from belief_lm.parallel import env as process_env
from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.train.components import data_collective
from data_pipeline.build import build_tokenizer, build_train_data, check_data


def main(out: str, phase: str, *overrides: str) -> None:
    cfg = load_config(None, list(overrides))
    device = torch.device("cpu")
    check_data(cfg.data)  # as the trainer's pre-flight, before any process group
    env = process_env.detect()
    grid = ProcessGrid.join(env, device, ParallelDims(env.world_size, 1, 1))
    layout = grid.layout
    # rank 0 trains the tokenizer, the others wait and load it from the cache
    tokenizer = grid.rank_zero_first(lambda: build_tokenizer(cfg.data, cfg.run.cache_dir))

    def stream():
        return build_train_data(
            cfg.data, tokenizer, cfg.model.seq_length, cfg.train.global_batch_size,
            cfg.train.micro_batch_size, layout.data_rank, layout.data, device,
            data_collective(grid),
        )  # fmt: skip

    def run(data, steps: int) -> list:
        """The global batches (every rank's windows, in rank order) of `steps` steps."""
        batches = []
        for _ in range(steps):
            mine = step_windows(data.next_step())
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            batches.append([w for rank in every for w in rank])
        data.close()
        return batches

    def save(value, name: str) -> None:
        if dist.get_rank() == 0:
            torch.save(value, Path(out) / f"{name}.pt")

    if phase == "first":
        save(run(stream(), 12), "full")
        first = stream()
        save(run(first, 5), "first")
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, first.state_dict())
        assert all(states_equal(s, states[0]) for s in states)  # every rank holds all of it
        save(states[-1], "state")
    else:
        resumed = stream()
        resumed.load_state_dict(torch.load(Path(out) / "state.pt", weights_only=False))
        save(run(resumed, 7), f"resumed-{dist.get_world_size()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
