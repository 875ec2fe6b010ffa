"""Faults: a non-finite loss on one rank is skipped by every rank together; too many in a
row stop the run with a clear error; a killed rank ends the job quickly."""

import math
import os
import signal
import subprocess
import time

import pytest
import torch

from tests.jobs import start_cli, stop_job
from tests.parallel.conftest import torchrun


def fault_run(tmp_path, cache_dir, nproc, nan_steps, nan_rank, *overrides):
    overrides = [
        "model.ffn_hidden_size=96", "train.global_batch_size=4", "train.warmup_steps=1",
        f"run.output_dir={tmp_path}/run", f"run.cache_dir={cache_dir}", *overrides,
    ]  # fmt: skip
    result = torchrun(
        nproc, "tests/parallel/faults.py", str(tmp_path), nan_steps, str(nan_rank), *overrides,
        timeout=400,
    )  # fmt: skip
    records = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
    return result, records


@pytest.mark.parametrize(
    ("layout", "nan_rank"),
    [(["parallel.tensor=2"], 3), (["parallel.pipeline=2", "parallel.zero_stage=0"], 0)],
    ids=["tp2-dp2", "pp2-dp2-zero0"],
)
def test_nonfinite_step_is_skipped_everywhere(tmp_path, cache_dir, layout, nan_rank):
    result, records = fault_run(tmp_path, cache_dir, 4, "3", nan_rank, *layout)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank, record in enumerate(records):
        assert record["result"].skipped_steps == [3], rank
        sums = record["checksums"]
        assert sums[2][0] == sums[2][1], f"rank {rank} changed its weights on the skipped step"
        assert all(before != after for i, (before, after) in enumerate(sums) if i != 2), rank
        losses = record["result"].losses
        assert math.isnan(losses[3]), losses
        assert all(math.isfinite(losses[s]) for s in (1, 2, 4, 5, 6)), losses


def test_too_many_nonfinite_steps_stop_every_rank(tmp_path, cache_dir):
    start = time.monotonic()
    result, records = fault_run(tmp_path, cache_dir, 2, "2,3", 1, "train.max_nonfinite_steps=2")
    assert result.returncode != 0
    assert time.monotonic() - start < 300
    for record in records:
        assert "2 consecutive steps (up to step 3) had non-finite gradients" in record["error"]


def test_killed_rank_ends_the_job(tmp_path, cache_dir):
    """SIGKILL one of two ranks mid-training: torchrun stops the other and exits non-zero
    well before any collective timeout."""
    job = start_cli(
        "train", "--config", "configs/tiny.yaml",
        "model.num_layers=1", "train.max_steps=100000", "run.tensorboard=false",
        "train.micro_batch_size=4", "train.global_batch_size=8", "parallel.timeout_s=1800",
        f"run.output_dir={tmp_path}", f"run.cache_dir={cache_dir}", nproc=2,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while (
            not (tmp_path / "metrics.jsonl").exists()
            or not (tmp_path / "metrics.jsonl").read_text()
        ):
            assert job.poll() is None, job.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(1)
        workers = subprocess.run(
            ["pgrep", "-f", "-P", str(job.pid), "belief_lm.cli"], capture_output=True, text=True
        )
        victim = int(workers.stdout.split()[-1])
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        returncode = job.wait(timeout=120)
        assert returncode != 0
        assert time.monotonic() - killed_at < 60
    finally:
        if job.poll() is None:
            stop_job(job)
