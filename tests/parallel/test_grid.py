"""The process grid (belief_lm.parallel.grid) in one process: megatron's groups and
DeepSpeed's topology describe one grid (the rank order both are built in), and what a grid
of one process does with its side groups (the multi-rank behaviour: the runs of
tests/parallel and tests/launcher)."""

import pytest
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core.parallel_state import RankGenerator

from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.grid import RANK_ORDER, ProcessGrid


@pytest.mark.parametrize(
    ("tensor", "pipeline", "data"), [(2, 2, 2), (4, 1, 2), (1, 4, 2), (2, 3, 1), (1, 1, 8)]
)
def test_megatron_and_deepspeed_lay_ranks_out_alike(tensor, pipeline, data):
    """The grid builds megatron's groups in RANK_ORDER and DeepSpeed's topology from the
    same sizes: the same tensor, data and pipeline groups, rank for rank (a pipeline stage
    built from the topology sits where megatron's pipeline rank says)."""
    megatron = RankGenerator(tp=tensor, ep=1, dp=data, pp=pipeline, cp=1, order=RANK_ORDER)
    deepspeed = PipeModelDataParallelTopology(num_pp=pipeline, num_mp=tensor, num_dp=data)
    for ours, theirs in (("tp", "model"), ("dp", "data"), ("pp", "pipe")):
        assert sorted(megatron.get_ranks(ours)) == sorted(deepspeed.get_axis_comm_lists(theirs))
    for rank in range(tensor * pipeline * data):
        coord = deepspeed.get_coord(rank)
        where = {axis: next(g.index(rank) for g in megatron.get_ranks(axis) if rank in g)
                 for axis in ("tp", "dp", "pp")}  # fmt: skip
        assert (coord.model, coord.data, coord.pipe) == (where["tp"], where["dp"], where["pp"])


def test_the_rank_order_check_fails_for_another_order():
    """The check above can fail: megatron's groups built pipeline-before-data differ."""
    megatron = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    deepspeed = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert sorted(megatron.get_ranks("dp")) != sorted(deepspeed.get_axis_comm_lists("data"))


def test_a_grid_of_one_process(single_process_group):
    grid = single_process_group
    assert grid.dims == ParallelDims(1, 1, 1) and grid.world_size == 1
    assert (grid.layout.tensor_rank, grid.layout.data_rank, grid.layout.pipeline_rank) == (0, 0, 0)
    assert grid.checkpoint_group is None  # no side groups: nothing to agree on
    assert grid.any_rank(True) and not grid.any_rank(False)
    calls = []
    assert grid.rank_zero_first(lambda: calls.append(1) or "done") == "done" and calls == [1]
    assert grid.on_rank_zero(lambda: 7) == 7
    # megatron's groups are named for the line that reports a timeout in one
    assert grid.peers.role(grid.tensor_group) == "the tensor-parallel group"
    assert grid.peers.role(grid.data_group) in {
        "the data-parallel group",
        "the tensor-parallel group",
    }
    assert grid.peers.role(None) == "the world"
    assert grid.peers.role(dist.new_group(backend="gloo")) == "a group"
    # the heartbeat: none in a job of one process, beating is a no-op
    grid.beat(3)
    assert grid.peers.watch is None


def test_a_grid_is_for_the_whole_job(single_process_group):
    with pytest.raises(ValueError, match="a grid of 2 processes in a job of 1"):
        ProcessGrid(ParallelDims(2, 1, 1), single_process_group.peers)
