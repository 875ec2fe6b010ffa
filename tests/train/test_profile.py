"""The CUDA memory snapshot of a profiled stretch (belief_lm.train.profile): its calls into
torch's private allocator-history API checked on the CPU with those calls stood in for,
and the real thing on a GPU. The trace itself is tested on a real run in test_observe.py."""

import pickle

import pytest
import torch

from belief_lm.config import ProfileConfig
from belief_lm.train.profile import MEMORY_HISTORY_ENTRIES, StepProfiler


def profile_steps(profiler: StepProfiler, steps: range, work=lambda step: None) -> None:
    for step in steps:
        with profiler.step(step):
            work(step)


@pytest.mark.filterwarnings("ignore:CUDA is not available")  # the profiler's CUDA part
@pytest.mark.parametrize(("first_run_step", "snapshot_step"), [(1, 2), (3, 3)])
def test_memory_history_recorded_over_the_first_profiled_step_only(
    tmp_path, monkeypatch, first_run_step, snapshot_step
):
    """Steps 2-3 profiled: the history is recorded from the first profiled step, dumped to
    profile/memory_rank<R>_step<A>.pickle after it, and no longer recorded; a run resumed
    inside the range (its first step 3) snapshots its own first step."""
    calls = []
    memory = torch.cuda.memory
    monkeypatch.setattr(
        memory, "_record_memory_history", lambda **options: calls.append(("record", options))
    )
    monkeypatch.setattr(memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    cfg = ProfileConfig(start_step=2, steps=2)
    profiler = StepProfiler(cfg, tmp_path, torch.device("cuda"), rank=1)
    profile_steps(profiler, range(first_run_step, 5), lambda step: calls.append(("step", step)))

    snapshot = tmp_path / "profile" / f"memory_rank1_step{snapshot_step}.pickle"
    recorded = [("record", {"max_entries": MEMORY_HISTORY_ENTRIES}), ("step", snapshot_step)]
    stopped = [("dump", str(snapshot)), ("record", {"enabled": None})]
    before = [("step", s) for s in range(first_run_step, snapshot_step)]
    after = [("step", s) for s in range(snapshot_step + 1, 5)]
    assert calls == before + recorded + stopped + after


MIB = 1 << 20


def allocations(snapshot: dict) -> set[int]:
    """The sizes the allocator's recorded history holds allocations of."""
    return {
        e["size"] for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_snapshot_on_the_gpu(tmp_path):
    """A real snapshot on a GPU: step 1's allocation (4 MiB) in it, step 2's (8 MiB) neither
    in it nor in the history afterwards (recording stopped)."""
    profiler = StepProfiler(ProfileConfig(start_step=1, steps=2), tmp_path, torch.device("cuda"), 0)
    kept = []
    profile_steps(profiler, range(1, 3), lambda s: kept.append(torch.ones(s * MIB, device="cuda")))

    snapshot = pickle.loads((tmp_path / "profile" / "memory_rank0_step1.pickle").read_bytes())
    assert 4 * MIB in allocations(snapshot) and 8 * MIB not in allocations(snapshot)
    assert 8 * MIB not in allocations(torch.cuda.memory._snapshot())
    assert (tmp_path / "profile" / "rank0_steps1-2.pt.trace.json").is_file()
