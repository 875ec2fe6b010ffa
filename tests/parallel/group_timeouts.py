"""torchrun driver: the process groups of a real training run and their timeouts.

    torchrun --nproc_per_node=N tests/parallel/group_timeouts.py OUT_DIR [overrides]

Trains the micro run (its process groups, DeepSpeed's engine, a stop-request agreement,
rank_zero_first's waits), then writes OUT_DIR/rank<r>.json: {"groups": [[ranks, timeout
in seconds], ...] for every process group this rank is a member of, "rank_zero_first":
the timeout of rank_zero_first's group}.
"""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from belief_lm import compat  # noqa: E402
from belief_lm.config import load_config  # noqa: E402
from belief_lm.parallel.grid import ProcessGrid  # noqa: E402
from belief_lm.train.loop import train  # noqa: E402


def main():
    out_dir, *overrides = sys.argv[1:]
    grids, join = [], ProcessGrid.join

    def joining(*args, **kwargs):  # the run's grid, kept to name its groups afterwards
        grids.append(join(*args, **kwargs))
        return grids[-1]

    ProcessGrid.join = joining
    train(load_config("configs/test/micro.yaml", overrides))
    (grid,) = grids
    groups = [
        (dist.get_process_group_ranks(group), compat.group_timeout(group).total_seconds(),
         grid.peers.role(group))
        for group in compat.all_groups()
    ]  # fmt: skip
    with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as file:
        json.dump(groups, file)


if __name__ == "__main__":
    main()
