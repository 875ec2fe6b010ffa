"""Who am I in the job: rank, local rank, world size and rendezvous address, derived from
the environment of whichever launcher started this process."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str
    """'torchrun' or 'single' (a plain `python`/`belief-lm` process)."""

    def export(self) -> None:
        """Set the variables torch.distributed's env:// rendezvous reads."""
        os.environ.update(
            RANK=str(self.rank),
            LOCAL_RANK=str(self.local_rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def detect(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """ProcessEnv from torchrun's variables, or a single process on a free local port."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not")
        return ProcessEnv(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env["WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            launcher="torchrun",
        )
    return ProcessEnv(0, 0, 1, "127.0.0.1", free_port(), "single")


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
