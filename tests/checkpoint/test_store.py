"""Finding the checkpoint to resume from: only complete ones, whatever a crash left."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from belief_lm.checkpoint.files import (
    CheckpointError,
    CheckpointInfo,
    complete_checkpoints,
    newest_checkpoint,
    problems,
    read_info,
    read_latest,
)
from belief_lm.checkpoint.manifest import seal, write_manifest
from belief_lm.checkpoint.store import Checkpointer, delete_old, rng_state, save
from belief_lm.checkpoint.writer import HOLD_ENV
from tests.checkpoint.damage import assert_same_checkpoint

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
    seal(path)  # as belief-lm's save would (a corrupt run.json: as saved so)
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
    hostile = [("step", "6"), ("complete", "yes"), ("tensor", -1), ("zero_stage", 1.5)]
    for step, (field, value) in enumerate(hostile, start=6):  # run.json of the wrong shape
        body = json.dumps({"step": step, **INFO, field: value})
        with pytest.raises(CheckpointError, match=rf"corrupt run\.json \({field}="):
            read_info(make(tmp_path, step, run_json=body))
    for step, text in ((10, "[1, 2]"), (11, b"\xff\xfe".decode("latin-1")), (12, '"x"')):
        with pytest.raises(CheckpointError, match=r"corrupt run\.json"):
            read_info(make(tmp_path, step, run_json=text))


@pytest.mark.parametrize(
    ("name", "size", "message"),
    [
        ("../outside", 1, "not a file inside the checkpoint"),
        ("/etc/passwd", 1, "not a file inside the checkpoint"),
        ("run.json", "big", "gives run.json the size 'big'"),
        ("run.json", -1, "gives run.json the size -1"),
    ],
    ids=["parent", "absolute", "size", "negative"],
)
def test_a_hostile_manifest_is_corrupt(tmp_path, name, size, message):
    """A manifest whose own checksum matches (anyone can compute it: write_manifest does)
    but which names a file outside the checkpoint or gives a size that is no number of
    bytes: corrupt, nothing read."""
    from belief_lm.checkpoint.manifest import FileRecord, ManifestError, read_manifest

    write_manifest(tmp_path, {name: FileRecord(size, 0)})
    with pytest.raises(ManifestError, match=message):
        read_manifest(tmp_path)


@pytest.fixture(scope="module")
def engine(single_process_group):
    """DeepSpeed's real single-process engine around a small model (ZeRO-1)."""
    from belief_lm.config import load_config
    from tests.jobs import MICRO, ROOT
    from tests.models import trainee_for

    cfg = load_config(ROOT / MICRO, ["model.num_layers=1", "parallel.zero_stage=1"])
    return trainee_for(cfg, single_process_group, 256).engine


def saving(engine, root: Path, step: int) -> Path:
    return save(engine, root, CheckpointInfo(step=step, **INFO), {}, {}, {}, keep=3)


class Crash(Exception):
    """The process dies here (a simulated kill -9 or power cut)."""


def test_a_save_cut_short_anywhere_leaves_latest_on_a_complete_checkpoint(
    engine, tmp_path, monkeypatch
):
    """Every rename and deletion a save makes, in turn, is where the process dies: `latest`
    still names a complete checkpoint (the previous one until the new one is whole), and a
    resume finds it."""
    root = tmp_path / "checkpoints"
    first = saving(engine, root, 1)
    calls = []  # the save's renames and deletions under root, in order

    def recorded(original, crash_at=None):
        def call(*args, **kwargs):
            if str(args[0]).startswith(str(root)):
                calls.append((original.__name__, Path(args[-1]).name))
                if len(calls) == crash_at:
                    raise Crash(calls[-1])
            return original(*args, **kwargs)

        return call

    replace, rmtree = os.replace, shutil.rmtree
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", recorded(replace))
        patch.setattr(shutil, "rmtree", recorded(rmtree))
        saving(engine, root, 2)
    points = len(calls)
    assert ("replace", "step_000002") in calls and ("replace", "latest") in calls
    for crash_at in range(1, points + 1):
        calls.clear()
        with monkeypatch.context() as patch, pytest.raises(Crash):
            patch.setattr(os, "replace", recorded(replace, crash_at))
            patch.setattr(shutil, "rmtree", recorded(rmtree, crash_at))
            saving(engine, root, 3)
        latest = root / (root / "latest").read_text().strip()
        read_info(latest)  # complete, or this raises
        assert newest_checkpoint(root) == latest and latest.name in ("step_000002", "step_000003")
    assert first.exists()


def test_resaving_a_step_replaces_it_and_drops_its_universal_copy(engine, tmp_path):
    path = saving(engine, tmp_path, 4)
    universal = tmp_path / "step_000004-universal"
    universal.mkdir()  # converted from the old weights
    (universal / "run.json").write_text("{}")
    written = (path / "run.json").stat().st_mtime_ns
    path = saving(engine, tmp_path, 4)
    assert (path / "run.json").stat().st_mtime_ns > written
    assert not universal.exists()
    assert newest_checkpoint(tmp_path) == path


def test_a_background_save_holds_the_state_of_its_step(engine, tmp_path, monkeypatch):
    """A background save copies the state when it is called: what changes while it is
    written (held by the test hook after its first file) does not reach its files, which
    equal a synchronous save of that moment tensor for tensor (RNG states included); it is
    published only by `wait`."""
    state = {"rng": rng_state(), "counts": torch.arange(4)}
    info = CheckpointInfo(step=5, **INFO)
    now = Checkpointer(engine, tmp_path / "now", keep=2).save(info, state, {}, {})
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "step_000005").touch()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    later = Checkpointer(engine, tmp_path / "later", keep=2, background=True)
    path = later.save(info, state, {}, {}, wait=False)
    params = list(engine.module.parameters())
    before = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # training goes on while the copy is written
    state["counts"].add_(1)  # (this rank's state is written last: still held)
    assert not later.writer.done() and not path.exists()
    in_flight = tmp_path / "later" / ".tmp-step_000005"
    assert not (in_flight / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists(), (
        "DeepSpeed wrote its optimizer file itself, not through engine.checkpoint_engine: "
        "belief_lm.checkpoint.writer.install no longer puts the background writer in place"
    )
    assert read_latest(tmp_path / "later") is None
    (hold / "step_000005").unlink()
    assert later.wait() == path and read_latest(tmp_path / "later") == path.name
    assert not problems(path, checksums=True)
    assert_same_checkpoint(now, path, same_process=True)
    # the next background save copies into the same host buffers: the state of its step
    info = CheckpointInfo(step=6, **INFO)
    again = later.save(info, state, {}, {}, wait=False)
    assert later.wait() == again
    reference = Checkpointer(engine, tmp_path / "now", keep=2).save(info, state, {}, {})
    with torch.no_grad():
        for p, value in zip(params, before, strict=True):
            p.copy_(value)
    assert_same_checkpoint(reference, again, same_process=True)
    assert not problems(again, checksums=True) and not problems(path, checksums=True)


def test_keep_counts_only_intact_checkpoints(tmp_path):
    """keep=1 after checkpoints 2 and 4 (intact) and 6 and 8 (damaged since): 4, the
    newest intact one, stays with the damaged ones after it; 2 goes. With no intact one,
    nothing is deleted."""
    for step in (2, 4, 6, 8):
        (make(tmp_path, step) / "weights.pt").write_bytes(b"x" * 100)
        seal(tmp_path / f"step_{step:06d}")
    (tmp_path / "step_000006" / "weights.pt").write_bytes(b"x" * 50)  # cut short
    (tmp_path / "step_000008" / "manifest.json").unlink()
    delete_old(tmp_path, keep=1)
    assert [p.name for p in sorted(tmp_path.iterdir())] == [
        "step_000004", "step_000006", "step_000008",
    ]  # fmt: skip
    (tmp_path / "step_000004" / "weights.pt").unlink()
    delete_old(tmp_path, keep=1)
    assert len(list(tmp_path.iterdir())) == 3
