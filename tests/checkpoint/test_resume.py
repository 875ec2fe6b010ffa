"""Resume through the real training loop, in this process and as a command."""

import os
import re
import shutil
import signal

import pytest

from belief_lm.checkpoint.files import CheckpointError, newest_checkpoint, read_info
from belief_lm.config import load_config
from belief_lm.train.loop import train
from tests.jobs import MICRO, losses, metrics, processes_mentioning, start_cli, wait_for_rows

SMALL = [
    "model.seq_length=64", "train.micro_batch_size=4", "train.decay_steps=8",
    "data.num_workers=1",
]  # fmt: skip


def config(run_dir, cache_dir, *overrides):
    return load_config(
        MICRO, [*SMALL, f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", *overrides]
    )


WSD_Z_LOSS = [
    "train.lr_schedule=wsd", "train.wsd_decay_steps=6", "train.wsd_decay_shape=1-sqrt",
    "train.z_loss=1e-3",
]  # fmt: skip
"""A warmup-stable-decay schedule whose decay (steps 3-8) a save at step 4 cuts, and a
z-loss: both logged every step."""


def test_resume_is_bit_exact(tmp_path, cache_dir):
    """8 steps saving at 4 and 8; resumed from step 4 elsewhere, with an empty cache (as on
    another node): steps 5-8 identical (loss, and the learning rate and z-loss logged
    mid-decay), with the checkpoint's tokenizer (none trained)."""

    def scheduled(run_dir, cache, *overrides):
        return config(run_dir, cache, *WSD_Z_LOSS, *overrides)

    full = train(scheduled(tmp_path / "a", cache_dir, "train.max_steps=8", "checkpoint.interval=4"))
    step4 = tmp_path / "a" / "checkpoints" / "step_000004"
    assert read_info(step4).consumed_tokens == 4 * 8 * 64
    other_cache = tmp_path / "other-cache"
    resumed = train(
        scheduled(tmp_path / "b", other_cache, "train.max_steps=8", f"checkpoint.resume={step4}")
    )
    kept = [p.read_bytes() for p in other_cache.glob("tokenizers/*.model")]
    assert kept == [(step4 / "tokenizer.model").read_bytes()]  # a copy, none trained
    assert list(resumed.losses) == [5, 6, 7, 8]
    assert [resumed.losses[s] for s in (5, 6, 7, 8)] == [full.losses[s] for s in (5, 6, 7, 8)]
    logged = {run: {r["step"]: r for r in metrics(tmp_path / run) if "lr" in r}
              for run in ("a", "b")}  # fmt: skip
    lr = [logged["a"][s]["lr"] for s in range(1, 9)]
    assert lr[0] == pytest.approx(0.5 * lr[1]) and lr[1] == lr[2]  # warmup, stable
    assert lr[2] > lr[3] > lr[4] > lr[7] > 0  # the decay, 1-sqrt
    for key in ("lr", "z_loss"):
        assert [logged["b"][s][key] for s in (5, 6, 7, 8)] == [
            logged["a"][s][key] for s in (5, 6, 7, 8)
        ]
    assert all(0 < logged["a"][s]["z_loss"] < 1 for s in range(1, 9))
    # the run directory moved elsewhere, auto-resume there: nothing left to do at step 8,
    # and two more steps continue from step 8 like the run resumed from step 4
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "a", moved)
    assert train(scheduled(moved, cache_dir, "train.max_steps=8")).losses == {}
    assert [p.name for p in sorted((moved / "checkpoints").glob("step_*"))] == [
        "step_000004", "step_000008",
    ]  # fmt: skip
    # saving every step, keeping one: step 8, resumed from, is deleted, and step 10 saved
    longer = train(
        scheduled(
            moved, cache_dir, "train.max_steps=10", "checkpoint.interval=1", "checkpoint.keep=1"
        )
    )
    further = train(scheduled(tmp_path / "b", cache_dir, "train.max_steps=10"))
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


def _command(run_dir, cache_dir, *overrides, **popen):
    args = [f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", *SMALL, *overrides]
    return start_cli("train", "--config", MICRO, *args, **popen)


def test_ctrl_c_to_the_process_group_saves_and_exits_75(tmp_path, cache_dir):
    """SIGINT to the trainer and its 2 loader workers at once (a terminal's Ctrl-C), then
    SIGTERM while it stops: the workers pass both on and read on, the trainer finishes its
    step, saves once, and exits 75; the requeued job resumes there."""
    log = (tmp_path / "log").open("w")
    job = _command(
        tmp_path, cache_dir, "train.max_steps=100000", "train.decay_steps=100000",
        "data.num_workers=2", stderr=log, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for_rows(tmp_path, 2, job)
        os.killpg(job.pid, signal.SIGINT)
        os.killpg(job.pid, signal.SIGTERM)  # a second signal changes nothing
        assert job.wait(timeout=120) == 75, (tmp_path / "log").read_text()[-3000:]
    finally:
        job.kill()
    assert not processes_mentioning(str(tmp_path))  # the loader workers are gone too
    text = (tmp_path / "log").read_text()
    # one stop, named after whichever signal Python handled first: sent back to back, the
    # SIGTERM can be handled first (each signal's C handler runs in the thread the kernel
    # picks, and a busy machine may run the SIGINT one later)
    stops = re.findall(r"belief-lm: (SIG\w+): finishing the step", text)
    assert stops in (["SIGINT"], ["SIGTERM"]) and text.count("saved checkpoint") == 1, text
    step = read_info(newest_checkpoint(tmp_path / "checkpoints")).step
    assert step == max(losses(tmp_path)) >= 2
    # the requeued job resumes there and finishes
    job = _command(tmp_path, cache_dir, f"train.max_steps={step + 2}", "train.decay_steps=100000")
    assert job.wait(timeout=240) == 0, job.stderr.read()[-3000:]
    assert read_info(newest_checkpoint(tmp_path / "checkpoints")).step == step + 2


def test_a_stop_signal_to_one_loader_worker_saves_and_exits_75(tmp_path, cache_dir):
    """SIGTERM to one of the trainer's 2 loader workers and to nothing else: the worker
    tells its trainer, which finishes its step, saves and exits 75; resumed from there,
    the run's losses are those of an uninterrupted one."""
    import psutil

    reference = tmp_path / "reference"
    assert _command(reference, cache_dir, "train.max_steps=8").wait(timeout=240) == 0
    log = (tmp_path / "log").open("w")
    run = tmp_path / "run"
    job = _command(run, cache_dir, "train.max_steps=8", "data.num_workers=2", stderr=log)
    try:
        wait_for_rows(run, 2, job)
        workers = psutil.Process(job.pid).children()
        assert len(workers) == 2
        workers[1].send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) == 75, (tmp_path / "log").read_text()[-3000:]
    finally:
        job.kill()
    assert "SIGTERM: finishing the step" in (tmp_path / "log").read_text()
    step = read_info(newest_checkpoint(run / "checkpoints")).step
    assert 2 <= step < 8
    assert _command(run, cache_dir, "train.max_steps=8").wait(timeout=240) == 0
    assert losses(run) == losses(reference)
