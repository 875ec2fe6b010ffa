"""Consolidation reads back exactly the weights DeepSpeed held when the trainer saved, at
every layout: the fp32 masters wherever the optimizer keeps them (bf16 runs included),
else the module's weights."""

import pytest
import torch

from belief_lm.checkpoint.consolidate import consolidate
from tests.checkpoint.conftest import RUNS, STEPS, checkpoint

pytestmark = pytest.mark.slow
WITH_MASTERS = [n for n in RUNS if n.startswith("bf16") and n != "bf16-tp2-dp2-zero0"]


def held(run_dir, step: int = STEPS) -> dict[str, dict]:
    """What every rank recorded at the save of `step`: masters and module weights by name
    (a pipeline's tied embedding is on two stages: the same tensor)."""
    merged = {"masters": {}, "weights": {}}
    for path in sorted(run_dir.glob(f"live-{step}-rank*.pt")):
        for kind, tensors in torch.load(path).items():
            for name, tensor in tensors.items():
                merged[kind].setdefault(name, tensor)
    assert merged["weights"], f"nothing recorded in {run_dir}"
    return merged


@pytest.mark.parametrize("name", list(RUNS))
def test_consolidated_weights_are_what_deepspeed_held(saved_layouts, name):
    live = held(saved_layouts[name])
    state = consolidate(checkpoint(saved_layouts[name])).state_dict
    assert state.keys() == live["weights"].keys()
    for key, tensor in state.items():
        master = live["masters"][key]
        expected = master if master is not None else live["weights"][key]
        assert torch.equal(tensor, expected), key


@pytest.mark.parametrize("name", WITH_MASTERS)
def test_bf16_runs_consolidate_to_the_fp32_masters_not_the_bf16_weights(saved_layouts, name):
    """The bf16 weights are the masters rounded (DeepSpeed copies them after each step);
    consolidation returns the masters, almost none of which bf16 can represent."""
    live = held(saved_layouts[name])
    state = consolidate(checkpoint(saved_layouts[name])).state_dict
    rounded, total = 0, 0
    for key, tensor in state.items():
        master, weight = live["masters"][key], live["weights"][key]
        assert master is not None and torch.equal(tensor, master), key
        if weight is not None:  # ZeRO-3 partitions the module's weights away
            assert torch.equal(master.bfloat16().float(), weight), key
        rounded += int((tensor == tensor.bfloat16().float()).sum())
        total += tensor.numel()
    assert rounded < 0.01 * total


def test_bf16_without_pipeline_at_zero0_has_only_bf16_weights(saved_layouts):
    """DeepSpeed keeps no fp32 master there (it updates the bf16 weights in place): the
    consolidated weights are those, exactly."""
    run = saved_layouts["bf16-tp2-dp2-zero0"]
    assert all(master is None for master in held(run)["masters"].values())
    for tensor in consolidate(checkpoint(run)).state_dict.values():
        assert torch.equal(tensor, tensor.bfloat16().float())
