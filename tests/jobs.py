"""Running belief-lm (and torchrun) as subprocesses from tests: one command line, one clean
environment, always under a timeout that also stops torchrun's ranks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO = "configs/test/micro.yaml"
"""The tests' small run config (relative to ROOT, where jobs start)."""
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def job_env(extra: dict | None = None) -> dict:
    """This environment for a job: no rendezvous variables inherited (the job starts its
    own world), DeepSpeed on the CPU, one OpenMP thread per rank, unbuffered output, and
    this checkout first on the import path (not whatever belief_lm the venv resolves)."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    return {**env, **(extra or {})}


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node=nproc args...` with this interpreter."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", *args,
    ]  # fmt: skip


def cli_command(*args: str, nproc: int = 1) -> list[str]:
    """`belief-lm args...`: one process, or `nproc` ranks under torchrun."""
    if nproc == 1:
        return [sys.executable, "-m", "belief_lm.cli", *args]
    return torchrun_command(nproc, "-m", "belief_lm.cli", *args)


def run_cli(
    *args: str, nproc: int = 1, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `belief-lm args...` from the repository root to completion (text output)."""
    return run_job(cli_command(*args, nproc=nproc), timeout, cwd=ROOT, env=job_env(env))


def start_cli(*args: str, nproc: int = 1, env: dict | None = None, **popen) -> subprocess.Popen:
    """Start `belief-lm args...` in the background (stdout discarded, stderr piped as text
    unless `popen` says otherwise); stop it with stop_job."""
    options = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(cli_command(*args, nproc=nproc), cwd=ROOT, env=job_env(env), **options)


def stop_job(job: subprocess.Popen) -> None:
    """Stop a job that may run torchrun. torchrun's ranks run in sessions of their own, out
    of reach of a kill aimed at torchrun: SIGTERM lets it stop them; SIGKILL only if not,
    then to the job's whole process group when it leads one (a worker pool's processes hold
    the job's pipes open after the job itself is gone), and the wait for them is bounded."""
    job.terminate()
    try:
        job.communicate(timeout=30)
        return
    except subprocess.TimeoutExpired:
        job.kill()
    with contextlib.suppress(ProcessLookupError):  # not yet reaped: its group id is readable
        if os.getpgid(job.pid) == job.pid:
            os.killpg(job.pid, signal.SIGKILL)
    try:
        job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pipe in (job.stdout, job.stderr):
            if pipe:
                pipe.close()


def run_job(command: list[str], timeout: float, **options) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) that, on timeout, stops the
    job with stop_job (subprocess.run's SIGKILL to torchrun alone leaves its ranks running);
    the job leads a process group of its own, so that stop can reach all it started."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    job = subprocess.Popen(command, **pipes, start_new_session=True, **options)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except BaseException:  # the timeout, or pytest-timeout / Ctrl-C interrupting the wait
        stop_job(job)
        raise
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss by step, from a run's metrics.jsonl."""
    return {row["step"]: row["loss"] for row in metrics(run_dir) if "loss" in row}


def wait_for_rows(run_dir: Path, rows: int, job: subprocess.Popen, timeout: float = 240) -> None:
    """Wait until the running `job` has logged `rows` rows to metrics.jsonl."""
    deadline = time.monotonic() + timeout
    path = Path(run_dir) / "metrics.jsonl"
    while not path.exists() or len(path.read_text().splitlines()) < rows:
        assert job.poll() is None, f"the job ended with {job.returncode} before {rows} rows"
        assert time.monotonic() < deadline, "training did not progress"
        time.sleep(0.05)


def processes_mentioning(text: str) -> list[int]:
    """Pids of the live processes whose command line contains `text` (e.g. a run
    directory: its ranks and their loader workers)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it ended meanwhile
            continue
        if text in cmdline and state != "Z":  # a zombie has ended; its parent reaps it
            found.append(int(proc.name))
    return found
