"""Subprocess jobs for tests, under a timeout that also stops torchrun's ranks."""

from __future__ import annotations

import subprocess


def stop_job(job: subprocess.Popen) -> None:
    """Stop a job that may run torchrun. torchrun's ranks run in sessions of their own, out
    of reach of a kill aimed at torchrun: SIGTERM lets it stop them; SIGKILL only if not."""
    job.terminate()
    try:
        job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()


def run_job(command: list[str], timeout: float, **options) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True) that, on timeout, stops the
    job with stop_job (subprocess.run's SIGKILL to torchrun alone leaves its ranks running)."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    job = subprocess.Popen(command, **pipes, **options)
    try:
        stdout, stderr = job.communicate(timeout=timeout)
    except BaseException:  # the timeout, or pytest-timeout / Ctrl-C interrupting the wait
        stop_job(job)
        raise
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)
