"""Checkpoints written in the background (checkpoint.async_save), by the real command: the
same files as a synchronous save, tensor for tensor (one process, and two pipeline
stages); a stop signal while a background write is in flight waits for it (exit 75, both
checkpoints intact); SIGKILL in the middle of one leaves `latest` on the previous
checkpoint, and the resume is exact.

The writer's test hook (writer.HOLD_ENV) holds the background write of one checkpoint
after its first file until the test lets it go, so the signal lands inside the write.
"""

import os
import signal
import time

import pytest

from belief_lm.checkpoint.files import newest_checkpoint, problems, read_info, read_latest
from belief_lm.checkpoint.writer import HOLD_ENV
from tests.checkpoint.damage import assert_same_checkpoint
from tests.jobs import MICRO, losses, metrics, run_cli, start_cli, stop_job

pytestmark = pytest.mark.slow
RUN = ["train.max_steps=8", "train.decay_steps=8", "checkpoint.keep=10", "data.num_workers=0"]
ASYNC = "checkpoint.async_save=true"


def args(run_dir, cache_dir, *overrides) -> list[str]:
    return [
        "--config", MICRO, *RUN, f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}",
        *overrides,
    ]  # fmt: skip


def train(run_dir, cache_dir, *overrides, nproc: int = 1) -> dict[int, float]:
    done = run_cli("train", *args(run_dir, cache_dir, *overrides), nproc=nproc, timeout=400)
    assert done.returncode == 0, done.stderr[-5000:]
    return losses(run_dir)


def step_dir(run_dir, step: int):
    return run_dir / "checkpoints" / f"step_{step:06d}"


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory, cache_dir):
    """(run directory, losses) of 8 steps saving every 2, synchronously."""
    run_dir = tmp_path_factory.mktemp("sync")
    return run_dir, train(run_dir, cache_dir, "checkpoint.interval=2")


def test_a_background_save_writes_what_a_synchronous_one_does(synchronous, tmp_path, cache_dir):
    sync_dir, sync_losses = synchronous
    assert train(tmp_path, cache_dir, "checkpoint.interval=2", ASYNC) == sync_losses
    for step in (2, 4, 6, 8):
        assert not problems(step_dir(tmp_path, step), checksums=True)
        assert_same_checkpoint(step_dir(sync_dir, step), step_dir(tmp_path, step))
    assert read_latest(tmp_path / "checkpoints") == "step_000008"


def test_two_pipeline_stages_save_in_the_background_as_synchronously(tmp_path, cache_dir):
    """Every rank writes its own files in the background, and the checkpoint is published
    only once both have: with rank 1's write held back, rank 0's files are all written and
    training goes on, but step 4 stays unpublished until rank 1's are too. Then the same
    files as a synchronous save of the same run."""
    layout = ["parallel.pipeline=2", "checkpoint.interval=4"]
    sync_losses = train(tmp_path / "sync", cache_dir, *layout, nproc=2)
    run_dir, hold, log = tmp_path / "async", tmp_path / "hold", tmp_path / "log"
    hold.mkdir()
    (hold / "step_000004-rank1").touch()
    job = start_cli(
        "train", *args(run_dir, cache_dir, *layout, ASYNC), nproc=2, env={HOLD_ENV: str(hold)},
        stderr=log.open("w"),
    )  # fmt: skip
    try:
        in_flight = run_dir / "checkpoints" / ".tmp-step_000004"
        rows = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        rank0_last = in_flight / "run_state" / "rank00000.pt"  # (a rank writes it last)
        while not (rows.is_file() and rows.read_text().count("\n") >= 6 and rank0_last.is_file()):
            assert job.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert not (in_flight / "run_state" / "rank00001.pt").exists()
        assert not step_dir(run_dir, 4).exists()
        (hold / "step_000004-rank1").unlink()
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        stop_job(job)
    assert losses(run_dir) == sync_losses
    for step in (4, 8):
        assert not problems(step_dir(run_dir, step), checksums=True)
        assert_same_checkpoint(step_dir(tmp_path / "sync", step), step_dir(run_dir, step))


def start_held(run_dir, cache_dir, hold, log, *overrides):
    """The command training in the background with checkpoint step 4's background write
    held after its first file; returns once step 5 was trained while it is held."""
    hold.mkdir()
    (hold / "step_000004").touch()
    job = start_cli(
        "train", *args(run_dir, cache_dir, ASYNC, *overrides), env={HOLD_ENV: str(hold)},
        stderr=log.open("w"),
    )  # fmt: skip
    deadline = time.monotonic() + 240
    rows = run_dir / "metrics.jsonl"  # one row per step
    while not (rows.is_file() and rows.read_text().count("\n") >= 5):
        assert job.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "training did not reach step 5"
        time.sleep(0.05)
    assert (run_dir / "checkpoints" / ".tmp-step_000004").is_dir()
    assert not step_dir(run_dir, 4).exists()  # still being written: not published
    return job


def test_a_stop_signal_waits_for_the_save_in_flight(tmp_path, cache_dir):
    run_dir, log = tmp_path / "run", tmp_path / "log"
    job = start_held(run_dir, cache_dir, tmp_path / "hold", log, "checkpoint.interval=4")
    try:
        job.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while "waiting for the background save of step_000004" not in log.read_text():
            assert job.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        assert not step_dir(run_dir, 4).exists()
        (tmp_path / "hold" / "step_000004").unlink()  # the write goes on
        assert job.wait(timeout=120) == 75, log.read_text()[-3000:]
    finally:
        stop_job(job)
    stopped = read_info(newest_checkpoint(run_dir / "checkpoints")).step
    assert 5 <= stopped <= 8 and stopped == max(losses(run_dir))
    assert read_latest(run_dir / "checkpoints") == f"step_{stopped:06d}"
    for step in (4, stopped):
        assert not problems(step_dir(run_dir, step), checksums=True), step


def test_sigkill_during_a_background_write_resumes_exactly(synchronous, tmp_path, cache_dir):
    _, sync_losses = synchronous
    run_dir, log = tmp_path / "run", tmp_path / "log"
    job = start_held(run_dir, cache_dir, tmp_path / "hold", log, "checkpoint.interval=2")
    try:
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    finally:
        stop_job(job)
    root = run_dir / "checkpoints"
    assert read_latest(root) == "step_000002" and newest_checkpoint(root) == step_dir(run_dir, 2)
    assert not problems(step_dir(run_dir, 2), checksums=True)
    assert (root / ".tmp-step_000004").is_dir() and not step_dir(run_dir, 4).exists()
    assert train(run_dir, cache_dir, "checkpoint.interval=2") == sync_losses
    assert [row["step"] for row in metrics(run_dir)] == list(range(1, 9))
