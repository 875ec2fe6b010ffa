"""torchrun driver: rank_zero_first while rank 0's one-off work is slow, or rank 0 stops.

    torchrun --nproc_per_node=2 tests/parallel/rank_zero_wait.py OUT_DIR slow|silent

With heartbeats in OUT_DIR and parallel.timeout_s 4 s:
- slow: rank 0's work takes 6 s, alive all along; parallel.rank_zero_wait_s 2 s: rank 1
  gives up after 2 s;
- silent: rank 0 stops itself (SIGSTOP) in its work; parallel.rank_zero_wait_s 60 s: rank
  1 finds rank 0's heartbeat stale after 4 s.
Rank 1 writes OUT_DIR/rank1.json ({"seconds", "line", "silent"}), then kills rank 0 (its
pid from its heartbeat) in the silent case; rank 0 exits quietly once rank 1 is gone.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from belief_lm.parallel import heartbeat, peers
from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.env import detect
from belief_lm.parallel.grid import ProcessGrid


def main():
    out_dir, case = sys.argv[1:]
    env, wait_s = detect(), 2 if case == "slow" else 60
    # groups made at leisure (a loaded machine), then collectives watched at 4 s
    grid = ProcessGrid.join(
        env, torch.device("cpu"), ParallelDims(env.world_size, 1, 1), timeout_s=60,
        rank_zero_wait_s=wait_s,
    )  # fmt: skip
    grid.peers.start_watch(out_dir, timeout_s=4, rank_zero_wait_s=wait_s)

    def work():
        if dist.get_rank() == 0 and case == "slow":
            time.sleep(6)
        elif dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGSTOP)

    started = time.monotonic()
    try:
        grid.rank_zero_first(work)
    except peers.PeerLost as lost:
        seconds = time.monotonic() - started
        if dist.get_rank() == 1:
            with open(f"{out_dir}/rank1.json", "w") as file:
                json.dump({"seconds": seconds, "line": lost.line, "silent": lost.silent}, file)
            if case == "silent":
                os.kill(heartbeat.read(out_dir, [0])[0].pid, signal.SIGKILL)
        os._exit(0)
    except RuntimeError:  # rank 0, once rank 1 has gone
        os._exit(0)
    os._exit(1)  # rank_zero_first was to fail


if __name__ == "__main__":
    main()
