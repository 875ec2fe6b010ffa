"""Who am I in the job: rank, local rank, world size and rendezvous address, derived from
the environment of whichever launcher started this process (without importing torch, so
commands that only read configs start quickly; the device and backend that follow from the
local rank are belief_lm.runtime's device_for / backend_for).

Launchers, in order of precedence (torchrun inside a SLURM allocation is torchrun):
- torchrun: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (GROUP_RANK: node).
- SLURM (srun tasks, one per GPU): SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID and the
  step's task count; the master is the first host of the step's node list (rank 0 runs
  there under srun's block distribution) and the port is derived from the job id, so every
  task agrees without talking. MASTER_ADDR / MASTER_PORT, when set, take precedence.
- MPI: Open MPI's OMPI_COMM_WORLD_*, or PMI_RANK / PMI_SIZE (MPICH, Intel MPI, with
  MPI_LOCALRANKID). MPI does not tell where rank 0 runs: MASTER_ADDR must be exported.
- none of these: a single process on a free local port.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

from belief_lm.errors import BadInput

DEFAULT_PORT = 29500
"""torch.distributed's customary port, used when an MPI launch does not set MASTER_PORT."""


class LaunchEnvError(BadInput):
    """The launcher's environment is incomplete or malformed (the message names the variable)."""


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the job."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str
    """'torchrun', 'slurm', 'mpi' or 'single' (a plain `python`/`belief-lm` process)."""
    node_rank: int = 0
    """Index of this process's node in the job (0 when the launcher does not say)."""

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
    """ProcessEnv from the first launcher whose variables are present (see the module doc)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        found = _torchrun(env)
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        # an srun task; the batch script itself has SLURM_PROCID=0 and the job's task
        # count but no step: a process started there directly is on its own
        found = _slurm(env)
    elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        found = _mpi(env)
    else:
        return ProcessEnv(0, 0, 1, "127.0.0.1", free_port(), "single")
    if not 0 <= found.rank < found.world_size:
        raise LaunchEnvError(
            f"{found.launcher} environment: rank {found.rank} is outside world size "
            f"{found.world_size}"
        )
    return found


def _torchrun(env: Mapping[str, str]) -> ProcessEnv:
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise LaunchEnvError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not")
    return ProcessEnv(
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=_int(env, "WORLD_SIZE"),
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        launcher="torchrun",
        node_rank=_int(env, "GROUP_RANK", 0),
    )


def _slurm(env: Mapping[str, str]) -> ProcessEnv:
    # An srun task sees its step's values; SLURM_NTASKS / SLURM_JOB_NODELIST describe the
    # whole allocation, which a step may use only part of.
    size_var = _first_present(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    nodes_var = _first_present(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    master = env.get("MASTER_ADDR") or expand_nodelist(env[nodes_var], nodes_var)[0]
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    else:
        # Stable for every task of the job, different for jobs sharing a node, and below
        # Linux's ephemeral range (32768+) so no outgoing connection holds it.
        port = 20000 + _int(env, "SLURM_JOB_ID") % 10000
    return ProcessEnv(
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=_int(env, size_var),
        master_addr=master,
        master_port=port,
        launcher="slurm",
        node_rank=_int(env, "SLURM_NODEID", 0),
    )


def _mpi(env: Mapping[str, str]) -> ProcessEnv:
    if "OMPI_COMM_WORLD_RANK" in env:
        rank = _int(env, "OMPI_COMM_WORLD_RANK")
        size = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 0)
    else:
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank, local_size = _int(env, "MPI_LOCALRANKID", 0), _int(env, "MPI_LOCALNRANKS", 0)
    if "MASTER_ADDR" not in env:
        raise LaunchEnvError(
            "MPI launch without MASTER_ADDR: export the host of rank 0 "
            "(e.g. mpirun -x MASTER_ADDR=$(hostname) ...)"
        )
    return ProcessEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=size,
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT", DEFAULT_PORT),
        launcher="mpi",
        node_rank=rank // local_size if local_size else 0,
    )


def expand_nodelist(nodelist: str, variable: str = "node list") -> list[str]:
    """Host names of a SLURM node list, in order: 'gpu[01-03,07]' -> gpu01 gpu02 gpu03 gpu07
    (zero padding kept); 'a1,b[3-4]' -> a1 b3 b4; 'r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2."""
    hosts: list[str] = []
    for entry in _split_top_level(nodelist, variable):
        # 'pre[ranges]mid[ranges]...' (brackets checked balanced and unnested above): the
        # product of its literal parts and its range lists
        parts = re.split(r"\[([^\]]*)\]", entry)
        choices = [
            [p] if i % 2 == 0 else _ranges(p, nodelist, variable) for i, p in enumerate(parts)
        ]
        hosts.extend("".join(combo) for combo in product(*choices))
    return hosts


def _split_top_level(nodelist: str, variable: str) -> list[str]:
    entries, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise LaunchEnvError(f"{variable} {nodelist!r}: unbalanced brackets")
        if char == "," and depth == 0:
            entries.append(nodelist[start:i])
            start = i + 1
    entries.append(nodelist[start:])
    if depth or any(not e.strip() for e in entries):
        problem = "unbalanced brackets" if depth else "empty host name"
        raise LaunchEnvError(f"{variable} {nodelist!r}: {problem}")
    return entries


def _ranges(spec: str, nodelist: str, variable: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (the width of a range's start is kept)."""
    out = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match or (match[2] and int(match[2]) < int(match[1])):
            raise LaunchEnvError(f"{variable} {nodelist!r}: bad range {item!r} in [{spec}]")
        first, last = match[1], match[2] or match[1]
        out += [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    return out


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_present(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if name in env:
            return name
    raise LaunchEnvError(f"SLURM task environment without {' or '.join(names)}")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in env:
        if default is None:
            raise LaunchEnvError(f"{name} is not set")
        return default
    try:
        return int(env[name])
    except ValueError:
        raise LaunchEnvError(f"{name}={env[name]!r} is not an integer") from None
