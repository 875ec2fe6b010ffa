"""The torch.distributed internals belief_lm.compat relies on, checked on this
torch (a failure here names the assumption that broke), and what they give a real run:
every process group of a 2-rank pipelined run, DeepSpeed's own included, waits
parallel.timeout_s; rank_zero_first's waits parallel.rank_zero_wait_s."""

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from belief_lm import compat
from tests.parallel.conftest import torchrun


def test_a_group_made_without_a_timeout_gets_the_default(single_process_group):
    before = compat.default_group_timeout()
    try:
        compat.set_default_group_timeout(timedelta(seconds=77))
        assert compat.default_group_timeout() == timedelta(seconds=77), (
            "torch no longer reads distributed_c10d.default_pg_timeout for new groups"
        )
        group = dist.new_group(backend="gloo")
        assert compat.group_timeout(group) == timedelta(seconds=77)
        assert group in compat.all_groups()
    finally:
        compat.set_default_group_timeout(before)


def all_reduce_of_a_string(group):
    dist.all_reduce("not a tensor", group=group)


def test_a_failed_collective_names_itself_its_group_and_its_caller(single_process_group):
    group = dist.new_group(backend="gloo")
    with pytest.raises((TypeError, ValueError, RuntimeError)) as failure:
        all_reduce_of_a_string(group)
    found = compat.failed_collective(failure.value.__traceback__)
    assert found is not None, "the collective's frame is no longer in distributed_c10d.py"
    name, found_group, callers = found
    assert name == "all_reduce" and found_group is group
    assert callers[-1].f_code.co_name == "all_reduce_of_a_string"
    assert compat.failed_collective(ValueError().__traceback__) is None


@pytest.mark.slow
def test_every_group_of_a_run_waits_parallel_timeout_s(tmp_path, cache_dir):
    """PP=2: DeepSpeed's pipeline grid makes groups of its own (without a timeout)."""
    result = torchrun(
        2, "tests/parallel/group_timeouts.py", str(tmp_path), "parallel.pipeline=2",
        "parallel.timeout_s=123", "parallel.rank_zero_wait_s=456", "train.max_steps=2",
        f"run.output_dir={tmp_path / 'run'}", f"run.cache_dir={cache_dir}", timeout=400,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        groups = json.loads((tmp_path / f"rank{rank}.json").read_text())
        waits = {(tuple(ranks), role): timeout for ranks, timeout, role in groups}
        assert waits.pop(((0, 1), "rank_zero_first's group")) == 456 + 60
        assert set(waits.values()) == {123}, waits
        roles = {role for _, role in waits}
        assert {"the world", "the stop-request group", "the pipeline-parallel group"} <= roles
        assert len(waits) > 6, waits  # megatron's groups and DeepSpeed's
