"""Resume through the real training loop, in this process and as a command."""

import json
import shutil
import signal
import time

import pytest

from belief_lm.checkpoint.files import CheckpointError, newest_checkpoint, read_info
from belief_lm.config import load_config
from belief_lm.train.loop import train
from tests.jobs import MICRO, start_cli

SMALL = [
    "model.seq_length=64", "train.micro_batch_size=4", "train.decay_steps=8",
    "data.num_workers=1",
]  # fmt: skip


def config(run_dir, cache_dir, *overrides):
    return load_config(
        MICRO, [*SMALL, f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", *overrides]
    )


def test_resume_is_bit_exact(tmp_path, cache_dir):
    """8 steps saving at 4 and 8; resumed from step 4 elsewhere: steps 5-8 identical."""
    full = train(config(tmp_path / "a", cache_dir, "train.max_steps=8", "checkpoint.interval=4"))
    step4 = tmp_path / "a" / "checkpoints" / "step_000004"
    assert read_info(step4).consumed_tokens == 4 * 8 * 64
    resumed = train(
        config(tmp_path / "b", cache_dir, "train.max_steps=8", f"checkpoint.resume={step4}")
    )
    assert list(resumed.losses) == [5, 6, 7, 8]
    assert [resumed.losses[s] for s in (5, 6, 7, 8)] == [full.losses[s] for s in (5, 6, 7, 8)]
    # the run directory moved elsewhere, auto-resume there: nothing left to do at step 8,
    # and two more steps continue from step 8 like the run resumed from step 4
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "a", moved)
    assert train(config(moved, cache_dir, "train.max_steps=8")).losses == {}
    assert [p.name for p in sorted((moved / "checkpoints").glob("step_*"))] == [
        "step_000004", "step_000008",
    ]  # fmt: skip
    longer = train(config(moved, cache_dir, "train.max_steps=10"))
    further = train(config(tmp_path / "b", cache_dir, "train.max_steps=10"))
    assert list(longer.losses) == [9, 10]
    assert longer.losses == further.losses


def test_incompatible_config_is_refused(tmp_path, cache_dir):
    train(config(tmp_path, cache_dir, "train.max_steps=1"))
    with pytest.raises(CheckpointError, match=r"different model config: model.hidden_size"):
        train(config(tmp_path, cache_dir, "train.max_steps=2", "model.hidden_size=32"))
    with pytest.raises(CheckpointError, match="does not exist"):
        train(
            config(tmp_path, cache_dir, "train.max_steps=2", f"checkpoint.resume={tmp_path}/nope")
        )


def _command(run_dir, cache_dir, *overrides):
    args = [f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", *SMALL, *overrides]
    return start_cli("train", "--config", MICRO, *args)


def _wait_for_rows(run_dir, rows, job, timeout=240):
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < rows:
        assert job.poll() is None, job.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "training did not progress"
        time.sleep(0.05)


def test_stop_signal_saves_and_exits_75(tmp_path, cache_dir):
    job = _command(tmp_path, cache_dir, "train.max_steps=100000", "train.decay_steps=100000")
    try:
        _wait_for_rows(tmp_path, 2, job)
        job.send_signal(signal.SIGUSR1)
        assert job.wait(timeout=120) == 75, job.stderr.read()[-3000:]
    finally:
        job.kill()
    stopped = newest_checkpoint(tmp_path / "checkpoints")
    step = read_info(stopped).step
    logged = [json.loads(r)["step"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert step == logged[-1] >= 2
    # the requeued job resumes there and finishes
    job = _command(tmp_path, cache_dir, f"train.max_steps={step + 2}", "train.decay_steps=100000")
    assert job.wait(timeout=240) == 0, job.stderr.read()[-3000:]
    assert read_info(newest_checkpoint(tmp_path / "checkpoints")).step == step + 2


def test_kill_9_during_a_save_leaves_a_loadable_checkpoint(tmp_path, cache_dir):
    """Checkpoint every step; SIGKILL the moment a save is in progress (its temporary
    directory exists). `latest` still names a complete checkpoint, and resume works."""
    root = tmp_path / "checkpoints"
    job = _command(tmp_path, cache_dir, "train.max_steps=100000", "checkpoint.interval=1")
    try:
        _wait_for_rows(tmp_path, 2, job)
        deadline = time.monotonic() + 120
        while not list(root.glob(".tmp-step_*")):
            assert time.monotonic() < deadline and job.poll() is None
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        job.kill()
    latest = root / (root / "latest").read_text().strip()
    step = read_info(latest).step  # complete
    assert newest_checkpoint(root) == latest
    resumed = train(config(tmp_path, cache_dir, f"train.max_steps={step + 1}"))
    assert list(resumed.losses) == [step + 1]
