"""The process grid: the one owner of how this job's processes are grouped.

Built once from the layout pre-flight validated (`ParallelDims`), it makes every process
group a run uses and is handed to whoever needs one (the engine, the data stream's
agreement, stop requests, checkpoints, validation):
- megatron's tensor / pipeline / data / model-parallel groups (parallel_state, in the order
  tp-cp-ep-dp-pp: TP innermost, PP outermost), and DeepSpeed's pipeline topology from the
  same numbers (axes pipe, data, model: the same order, tests/parallel/test_grid.py);
- our own host-side (gloo) groups: the stop-request agreement, the checkpoint agreement and
  rank_zero_first's wait, made together here rather than at first use;
- `peers`: the groups' roles (for the line that reports a timeout) and, in a training run,
  the heartbeat watch (belief_lm.parallel.peers).

megatron's layers look their groups up in parallel_state themselves; outside this package
nothing else of ours does (tests/test_architecture.py holds the code to it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state as ps

from belief_lm import compat
from belief_lm.errors import BAD_INPUT, BadInput
from belief_lm.parallel.collectives import collective_device
from belief_lm.parallel.dims import Layout, ParallelDims
from belief_lm.parallel.env import ProcessEnv
from belief_lm.parallel.mpu import MegatronMPU
from belief_lm.parallel.peers import Peers
from belief_lm.parallel.setup import init_distributed

T = TypeVar("T")

RANK_ORDER = "tp-cp-ep-dp-pp"
"""megatron's order of the parallel dimensions, innermost first: the order of DeepSpeed's
PipeModelDataParallelTopology (model fastest, then data, then pipe)."""

RANK_ZERO_FIRST_TIMEOUT = timedelta(hours=2)
"""How long the other ranks wait for rank 0's first run (training a tokenizer on a large
sample, converting a large checkpoint) outside a training run; a training run waits
parallel.rank_zero_wait_s."""


@dataclass(frozen=True)
class SideGroups:
    """Our own groups of the whole job: gloo, for host-side flags and small objects whatever
    the job's backend (NCCL reduces only GPU tensors). Made together when the grid is, and
    kept for the job's life: destroying a gloo group after a wait deadlocked on torch 2.6
    (its destructor joins its worker threads holding the GIL while a worker, freeing the
    finished broadcast's tensors, waits for the GIL)."""

    stop_requests: dist.ProcessGroup
    """Where the ranks agree whether any got a stop signal (`ProcessGrid.any_rank`)."""
    checkpoints: dist.ProcessGroup
    """Where the ranks agree that a checkpoint's files are written (checkpoint.store)."""
    rank_zero_wait: dist.ProcessGroup
    """Where the others wait for rank 0's one-off work (`ProcessGrid.rank_zero_first`)."""

    @classmethod
    def make(cls, peers: Peers, rank_zero_wait_s: float | None) -> SideGroups:
        """The groups, named in `peers`. rank_zero_first's waits a minute past
        `rank_zero_wait_s` (parallel.rank_zero_wait_s), so the watch's clearer message
        comes first; the others the job's collective timeout."""
        wait = RANK_ZERO_FIRST_TIMEOUT
        if rank_zero_wait_s is not None:
            wait = timedelta(seconds=rank_zero_wait_s + 60)

        def group(role: str, timeout: timedelta | None = None) -> dist.ProcessGroup:
            return peers.name(dist.new_group(backend="gloo", timeout=timeout), role)

        return cls(
            stop_requests=group("the stop-request group"),
            checkpoints=group("the checkpoint-agreement group"),
            rank_zero_wait=group("rank_zero_first's group", wait),
        )


class ProcessGrid:
    """This job's processes as a tensor x pipeline x data grid, and every group of it (see
    the module docstring). Make one with `join` (or `single_process`); collective: every
    rank makes it at the same point."""

    def __init__(self, dims: ParallelDims, peers: Peers, rank_zero_wait_s: float | None = None):
        world = dist.get_world_size()
        if dims.world_size != world:
            raise ValueError(f"a grid of {dims.world_size} processes in a job of {world}")
        self.dims = dims
        self.peers = peers
        self.layout = _megatron_groups(dims)
        """This rank's place in the grid."""
        self.topology = PipeModelDataParallelTopology(
            num_pp=dims.pipeline, num_mp=dims.tensor, num_dp=dims.data
        )
        """DeepSpeed's description of the same grid (for a pipeline's stages)."""
        self.mpu = MegatronMPU()
        """megatron's groups as DeepSpeed's engine asks for them (`mpu=`)."""
        for role, group in reversed(self._megatron_roles()):  # (the first role wins)
            peers.name(group, role)
        self.side = None if world == 1 else SideGroups.make(peers, rank_zero_wait_s)
        """Our host-side groups (None: a job of one process has nothing to agree on)."""

    @classmethod
    def join(
        cls,
        env: ProcessEnv,
        device: torch.device,
        dims: ParallelDims,
        *,
        timeout_s: float = 600,
        heartbeat_dir: str | Path | None = None,
        rank_zero_wait_s: float | None = None,
    ) -> ProcessGrid:
        """Join the job's processes (belief_lm.parallel.setup.init_distributed: `timeout_s`
        bounds every collective) and lay them out as `dims`. `heartbeat_dir`: start this
        rank's heartbeat there (a training run: its output directory); `rank_zero_wait_s`:
        how long rank_zero_first waits for rank 0 (parallel.rank_zero_wait_s). A peer lost
        meanwhile raises PeerLost."""
        init_distributed(env, device, timeout_s)
        peers = Peers()
        with peers.reporting():
            if heartbeat_dir is not None:
                wait_s = rank_zero_wait_s
                if wait_s is None:
                    wait_s = RANK_ZERO_FIRST_TIMEOUT.total_seconds()
                peers.start_watch(heartbeat_dir, timeout_s, wait_s)
            return cls(dims, peers, rank_zero_wait_s)

    @classmethod
    def single_process(cls) -> ProcessGrid:
        """The grid of a one-process job (generation, export, tests): megatron's layers need
        its groups even here. A gloo group of world size 1 unless this process is in one
        already; its in-memory store needs no port, and it skips DeepSpeed's start-up,
        which builds its CPU communication op every time (seconds to a minute)."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return cls(ParallelDims(dist.get_world_size(), 1, 1), Peers())

    # where this rank is
    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def tensor_group(self) -> dist.ProcessGroup:
        return ps.get_tensor_model_parallel_group()

    @property
    def data_group(self) -> dist.ProcessGroup:
        return ps.get_data_parallel_group()

    @property
    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The group checkpoints agree in (None: a job of one process)."""
        return None if self.side is None else self.side.checkpoints

    # collectives of the whole run
    @contextlib.contextmanager
    def watching(self) -> Iterator[ProcessGrid]:
        """Raise PeerLost for a collective that fails inside because a peer is silent or
        gone (the one line that says which); stop the heartbeat on the way out."""
        try:
            with self.peers.reporting():
                yield self
        finally:
            self.peers.stop()

    def beat(self, step: int) -> None:
        """Tell the heartbeat (if any) the optimizer steps done so far."""
        self.peers.beat(step)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (one all-reduce on the stop-request group;
        collective: every rank calls it at the same point)."""
        if self.side is None:
            return flag
        total = torch.tensor(int(flag), dtype=torch.int32)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.side.stop_requests)
        return bool(total)

    def data_parallel_mean(self, value: torch.Tensor) -> float:
        """`value` averaged over the data-parallel ranks, on every rank (collective)."""
        size = dist.get_world_size(self.data_group)
        if size > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.data_group)
            value /= size
        return value.item()  # host-device sync

    def sum_over_job(self, values: torch.Tensor) -> torch.Tensor:
        """`values` summed over every rank of the job, on the host (collective)."""
        total = values.to(collective_device())
        dist.all_reduce(total)
        return total.cpu()

    def gather_objects(self, value: object) -> list:
        """Every rank's `value` (a small picklable object), in rank order (collective)."""
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values

    def rank_zero_first(self, work: Callable[[], T]) -> T:
        """`work()` on rank 0, then on every other rank once rank 0 is done. For idempotent
        work whose first run fills a cache the others then read (a trained tokenizer, a
        checkpoint converted to the universal form). Collective.

        The wait is on a gloo group of its own with a long timeout (parallel.rank_zero_wait_s
        in a training run): the job's default group may be NCCL (a GPU barrier) with a
        timeout sized for collectives, not for this. Meanwhile the others watch rank 0's
        heartbeat: a rank 0 silent for parallel.timeout_s is lost (PeerLost) long before
        the wait would end. If rank 0's run fails, every rank fails at once with its
        message (bad input stays bad input, belief_lm.errors.BadInput, reported as such
        everywhere) instead of waiting.
        """
        if self.side is None:
            return work()
        group = self.side.rank_zero_wait
        result, failure = None, None
        if self.rank == 0:
            try:
                result = work()
            except Exception as err:  # told to the others below, then raised here
                failure = err
        done = torch.zeros(1)
        waiting = dist.broadcast(done, src=0, group=group, async_op=True)
        self.peers.wait_for_rank_zero(waiting, "rank_zero_first's wait for rank 0")
        outcome = [None if failure is None else (isinstance(failure, BAD_INPUT), str(failure))]
        dist.broadcast_object_list(outcome, src=0, group=group)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            bad_input, message = outcome[0]
            raise (BadInput if bad_input else RuntimeError)(f"on rank 0: {message}")
        return result if self.rank == 0 else work()

    def on_rank_zero(self, work: Callable[[], T]) -> T | None:
        """`work()` on rank 0 while the other ranks wait (collective, as rank_zero_first: if
        it fails, every rank fails with its message); None on the other ranks."""
        rank = self.rank
        return self.rank_zero_first(lambda: work() if rank == 0 else None)

    @staticmethod
    def _megatron_roles() -> list[tuple[str, dist.ProcessGroup]]:
        return [
            ("the tensor-parallel group", ps.get_tensor_model_parallel_group()),
            ("the pipeline-parallel group", ps.get_pipeline_model_parallel_group()),
            ("the model-parallel group", ps.get_model_parallel_group()),
            ("the data-parallel group", ps.get_data_parallel_group()),
        ]


def _megatron_groups(dims: ParallelDims) -> Layout:
    """Make megatron's process groups for `dims` (or keep those of an earlier grid of the
    same sizes in this process: tests, benchmarks) and return this rank's place."""
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == dims.tensor
            and ps.get_pipeline_model_parallel_world_size() == dims.pipeline
        )
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tensor,
            pipeline_model_parallel_size=dims.pipeline,
            # the job's collective timeout (megatron takes minutes; a fraction is fine)
            distributed_timeout_minutes=compat.default_group_timeout().total_seconds() / 60,
            order=RANK_ORDER,
        )
    return Layout(
        tensor=dims.tensor,
        pipeline=dims.pipeline,
        data=dims.data,
        tensor_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_rank=ps.get_pipeline_model_parallel_rank(),
        data_rank=ps.get_data_parallel_rank(),
    )
