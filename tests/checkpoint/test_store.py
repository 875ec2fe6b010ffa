"""Finding the checkpoint to resume from: only complete ones, whatever a crash left."""

import json
from pathlib import Path

import pytest

from belief_lm.checkpoint.files import (
    CheckpointError,
    CheckpointInfo,
    complete_checkpoints,
    newest_checkpoint,
    read_info,
)
from belief_lm.checkpoint.store import save

INFO = {
    "consumed_tokens": 0,
    "tensor": 1,
    "pipeline": 1,
    "data": 1,
    "zero_stage": 1,
    "vocab_size": 256,
}


def make(root, step, complete=True, run_json=None):
    path = root / f"step_{step:06d}"
    path.mkdir(parents=True)
    if run_json is not None:
        (path / "run.json").write_text(run_json)
    elif complete:
        (path / "run.json").write_text(json.dumps({"step": step, **INFO}))
    return path


def test_newest_complete_checkpoint_wins(tmp_path):
    make(tmp_path, 10)
    make(tmp_path, 20)
    make(tmp_path, 30, complete=False)  # killed before run.json was written
    (tmp_path / ".tmp-step_000040").mkdir()  # killed mid-save
    make(tmp_path, 50, run_json="{not json")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000010", "step_000020"]
    assert newest_checkpoint(tmp_path).name == "step_000020"


def test_latest_is_followed_only_when_complete(tmp_path):
    make(tmp_path, 10)
    make(tmp_path, 20)
    (tmp_path / "latest").write_text("step_000010")
    assert newest_checkpoint(tmp_path).name == "step_000010"  # latest names a complete one
    (tmp_path / "latest").write_text("step_000099")
    assert newest_checkpoint(tmp_path).name == "step_000020"
    assert newest_checkpoint(tmp_path / "nothing-here") is None


def test_read_info_names_the_problem(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_info(tmp_path / "step_000001")
    with pytest.raises(CheckpointError, match=r"incomplete \(no run.json\)"):
        read_info(make(tmp_path, 2, complete=False))
    with pytest.raises(CheckpointError, match=r"corrupt run\.json"):
        read_info(make(tmp_path, 3, run_json='{"step": 3}'))
    with pytest.raises(CheckpointError, match="marked incomplete"):
        read_info(make(tmp_path, 4, run_json=json.dumps({"step": 4, **INFO, "complete": False})))
    assert read_info(make(tmp_path, 5)).step == 5


class FakeEngine:
    """What save() asks of DeepSpeed's engine: write its files under root/tag."""

    def save_checkpoint(self, root, tag, client_state, save_latest):
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        (Path(root) / tag / "weights").write_text(str(client_state["weights"]))


def test_resaving_a_step_replaces_it_and_drops_its_universal_copy(tmp_path, single_process_group):
    info = CheckpointInfo(step=4, **INFO)
    save(FakeEngine(), tmp_path, info, {}, {}, {"weights": "old"}, keep=3)
    universal = tmp_path / "step_000004-universal"
    universal.mkdir()  # converted from the old weights
    (universal / "run.json").write_text("{}")
    path = save(FakeEngine(), tmp_path, info, {}, {}, {"weights": "new"}, keep=3)
    assert (path / "weights").read_text() == "new"
    assert not universal.exists()
    assert newest_checkpoint(tmp_path) == path
