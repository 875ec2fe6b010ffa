"""Faults at scale, as `launch local` meets them with real ranks: a silent rank (SIGSTOP)
ends the job within parallel.timeout_s + 60 s with exit 69 and one line naming the
collective and the rank; a dead rank (SIGKILL) is one line and its exit code, or, with
launch.failure_restarts, a restart in place that continues exactly as an uninterrupted
run. Nothing of a job is left running afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from belief_lm import exit_codes
from belief_lm.cli import main
from belief_lm.exit_codes import PEER_LOST
from belief_lm.parallel import heartbeat
from belief_lm.train import run_dir as run_directory
from launcher import local
from launcher.slurm import TEMPLATE, exit_code_settings
from tests.jobs import MICRO, ROOT, losses, processes_mentioning, start_cli, wait_for_rows
from tests.launcher.test_launch import children

SILENT_RANK = Path(__file__).with_name("silent_rank")
"""A sitecustomize that stops a chosen rank in its forward pass."""
STEPS = 40
"""Long enough that a fault sent after a few logged steps lands mid-run."""


def launch(run_dir: Path, log: Path, tasks: int, *overrides: str, cache_dir: str, env=None):
    """`belief-lm launch local` of the micro run with `tasks` ranks, stderr to `log`."""
    args = [
        "launch", "local", "--config", MICRO, f"launch.tasks_per_node={tasks}",
        f"train.max_steps={STEPS}", f"train.decay_steps={STEPS}", "checkpoint.interval=4",
        f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", *overrides,
    ]  # fmt: skip
    return start_cli(*args, stderr=log.open("w"), start_new_session=True, env=env)


def ended(job, run_dir: Path, timeout: float) -> int:
    """The job's exit code, once it and every process of it (ranks, loader workers) ended."""
    try:
        code = job.wait(timeout=timeout)
        deadline = time.monotonic() + 15
        while left := processes_mentioning(str(run_dir)):
            assert time.monotonic() < deadline, f"processes left running: {left}"
            time.sleep(0.2)
        return code
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)


def fault_lines(log: Path) -> list[str]:
    """Lines of the job's log that report a fault, and any traceback."""
    text = log.read_text()
    return [line for line in text.splitlines() if line.startswith(("belief-lm:", "Traceback"))]


def stopped(pid: int) -> bool:
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def assert_ends_naming(job, run_dir: Path, log: Path, silent: int, timeout_s: int, what: str):
    """The job whose rank `silent` just stopped ends within timeout_s + 60 s with exit 69,
    nothing left running, and one line: `what` (a collective over a group) timed out, rank 1
    did not arrive."""
    stopped_at = time.monotonic()
    code = ended(job, run_dir, timeout=timeout_s + 120)
    took = time.monotonic() - stopped_at
    print(f"ended {took:.1f} s after rank 1 stopped (parallel.timeout_s={timeout_s})")
    assert code == PEER_LOST, log.read_text()[-3000:]
    assert timeout_s - 1 < took < timeout_s + 60, took
    lines = fault_lines(log)
    assert len(lines) == 1, lines
    assert re.fullmatch(
        rf"belief-lm: rank \d: {what} in \S+:\d+ \w+ timed out after {timeout_s} s; not "
        rf"arrived: rank 1 \(host \S+, pid {silent}; last heartbeat \d+ s ago, at step \d+\)",
        lines[0],
    ), lines[0]
    return took


@pytest.mark.slow
def test_a_silent_rank_ends_the_job_within_the_timeout(tmp_path, cache_dir):
    """`kill -STOP` on rank 1 of 2 mid-run: the job ends within parallel.timeout_s + 60 s
    with exit 69 and one line naming the collective that timed out (whichever the other
    rank was in) and rank 1, and nothing of it is left running."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    job = launch(run_dir, log, 2, "parallel.timeout_s=15", f"train.max_steps={STEPS * 100}",
                 cache_dir=cache_dir)  # fmt: skip
    wait_for_rows(run_dir, 3, job, timeout=400)
    silent = children(job.pid)[1]
    os.kill(silent, signal.SIGSTOP)
    # (any collective: the step's all-reduces, DeepSpeed's parameter all-gather, ...)
    assert_ends_naming(job, run_dir, log, silent, 15, r"\w+ over [\w\s-]+ \(ranks 0-1\)")


@pytest.mark.slow
def test_a_silent_rank_found_by_its_tensor_parallel_peer(tmp_path, cache_dir):
    """TP2 x DP2: rank 1 stops itself in its first decoder layer's forward pass at step 4
    (tests/launcher/silent_rank), so its tensor-parallel peer, rank 0, waits for it in the
    layer's tensor-parallel collective (the all-gather of sequence parallelism, on by
    default at TP > 1; the all-reduce without it); the data-parallel peers wait for both.
    The job ends within the bound, the line names that collective, its group and rank 1."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    env = {"SILENT_RANK": "1", "SILENT_AT": "7", "PYTHONPATH": f"{SILENT_RANK}:{ROOT}"}
    job = launch(run_dir, log, 4, "parallel.tensor=2", "parallel.timeout_s=20",
                 cache_dir=cache_dir, env=env)  # fmt: skip
    deadline = time.monotonic() + 400
    while not (ranks := children(job.pid)) or 1 not in ranks or not stopped(ranks[1]):
        assert job.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "rank 1 never stopped"
        time.sleep(0.1)
    assert_ends_naming(
        job, run_dir, log, ranks[1], 20,
        r"(all_reduce|all_gather_into_tensor) over the tensor-parallel group \(ranks 0-1\)",
    )  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir) -> dict[int, float]:
    """The losses of the 2-rank run, never interrupted."""
    tmp = tmp_path_factory.mktemp("whole")
    job = launch(tmp / "run", tmp / "log", 2, cache_dir=cache_dir)
    assert ended(job, tmp / "run", timeout=400) == 0, (tmp / "log").read_text()[-3000:]
    return losses(tmp / "run")


def kill_rank_one_mid_run(run_dir: Path, log: Path, restarts: int, cache_dir: str) -> int:
    """SIGKILL rank 1 of a 2-rank job once 6 steps are logged (after the checkpoint of step
    4); the job's exit code once everything ended."""
    job = launch(run_dir, log, 2, f"launch.failure_restarts={restarts}", cache_dir=cache_dir)
    wait_for_rows(run_dir, 6, job, timeout=400)
    os.kill(children(job.pid)[1], signal.SIGKILL)
    return ended(job, run_dir, timeout=400)


@pytest.mark.slow
def test_a_dead_rank_is_one_line_and_its_exit_code(tmp_path, cache_dir):
    """Without failure restarts: the launcher names the rank and its signal in one line,
    the survivor exits quietly (no traceback), and the job exits with 137 (128 + SIGKILL)."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    code = kill_rank_one_mid_run(run_dir, log, 0, cache_dir)
    assert code == 128 + signal.SIGKILL, log.read_text()[-3000:]
    lines = fault_lines(log)
    assert len(lines) == 1, lines
    assert re.fullmatch(r"belief-lm: rank 1 \(pid \d+ on \S+\) was killed by SIGKILL", lines[0])
    assert len((run_dir / "starts.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
def test_a_dead_rank_restarts_in_place_and_continues_like_an_uninterrupted_run(
    tmp_path, cache_dir, uninterrupted
):
    """launch.failure_restarts=1: the ranks start again from the newest checkpoint, the job
    exits 0, every step's loss equals the uninterrupted run's bit for bit, and starts.jsonl
    records the restart's cause."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    code = kill_rank_one_mid_run(run_dir, log, 1, cache_dir)
    assert code == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert (
        "belief-lm: restarting the 2 ranks from the newest checkpoint (failure restart 1 of 1)"
        in text
    )
    assert "Traceback" not in text
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == uninterrupted
    starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]
    assert len(starts) == 2 and starts[0]["step"] == 0 and "restart" not in starts[0]
    assert starts[1]["step"] > 0 and starts[1]["step"] % 4 == 0  # a checkpoint's step
    restart = starts[1]["restart"]
    assert restart == {
        "restart": 1, "of": 1, "rank": 1, "host": restart["host"], "cause": "rank died",
        "signal": "SIGKILL",
    }  # fmt: skip


def test_the_launchers_know_the_trainers_files():
    """Job submission is torch-free and reads only the config and the exit codes: the
    names of the files it shares with the trainer are written twice, and held equal here."""
    assert local.RESTART_VARIABLE == run_directory.RESTART_VARIABLE
    assert local.HEARTBEATS == heartbeat.DIRECTORY
    assert f"export {run_directory.RESTART_VARIABLE}\n" in TEMPLATE.read_text()


def test_the_job_script_restarts_failed_steps_as_configured(capsys):
    code = main(["launch", "slurm", "--dry-run", "--config", MICRO, "launch.failure_restarts=3"])
    assert code == 0
    assert "\nFAILURE_RESTARTS=3\n" in capsys.readouterr().out


KILLED_BY_SRUN = "srun: First task exited 30s ago\n"  # what srun prints when --wait runs out


def template_functions(*names: str) -> str:
    """The job script template's bash functions `names`."""
    template = TEMPLATE.read_text()
    return "\n".join(
        re.search(rf"^{name}\(\) \{{.*?^\}}$", template, re.M | re.S)[0] for name in names
    )


def test_the_job_script_restarts_what_launch_local_restarts():
    """The template's restartable and launch local decide alike, from the same codes: a
    failed step restarts unless it ended done, on bad input, on loss spikes or stopped."""
    others = [exit_codes.FAILED, exit_codes.DATA_FAULT, exit_codes.PEER_LOST, 134, 137, 143]
    ends = [*exit_codes.NOT_RESTARTED, *others, 7]  # 7: a part of 75, not 75
    script = f"""set -euo pipefail
{exit_code_settings()}
{template_functions("restartable")}
for status in "$@"; do restartable "$status" && echo "$status restarts" || echo "$status ends"; done
"""
    out = subprocess.run(["bash", "-c", script, "-", *map(str, ends)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.split("\n")[:-1] == [
        f"{code} {'ends' if code in local.NOT_RESTARTED else 'restarts'}" for code in ends
    ]
    assert {exit_codes.DONE, exit_codes.BAD_INPUT, exit_codes.LOSS_SPIKES,
            exit_codes.PREEMPTED} == set(local.NOT_RESTARTED)  # fmt: skip


@pytest.mark.parametrize(
    ("srun_status", "errors", "status", "cause"),
    [
        (137, "srun: error: node2: task 1: Killed\nsrun: error: node1: task 0: Exited with "
         "exit code 69\n", 137, '"cause": "rank died", "rank": 1, "host": "node2", "signal": '
         '"SIGKILL"'),
        (137, "srun: error: node1: task 0: Exited with exit code 69\nsrun: error: node2: task "
         "1: Killed\n", 137, '"cause": "rank died", "rank": 1, "host": "node2", "signal": '
         '"SIGKILL"'),
        (69, "srun: error: node1: task 0: Exited with exit code 69\n", 69,
         '"cause": "peer lost", "rank": 0, "host": "node1", "exit_code": 69'),
        (1, "srun: error: node1: tasks 0-1: Exited with exit code 1\n", 1,
         '"cause": "rank failed", "rank": 0, "host": "node1", "exit_code": 1'),
        (143, "", 143, '"cause": "rank died", "rank": null, "host": "", "signal": "SIGTERM"'),
        (137, f"srun: error: node1: task 0: Exited with exit code 69\n{KILLED_BY_SRUN}srun: "
         "error: node2: task 1: Killed\n", 69, '"cause": "peer lost", "rank": 1, "host": '
         '"node2", "signal": "SIGKILL"'),
    ],
    ids=["died", "died-after-its-peer", "peer-lost", "failed", "without-srun-lines",
         "silent-killed-by-srun"],
)  # fmt: skip
def test_the_job_script_records_what_failed(tmp_path, srun_status, errors, status, cause):
    """The template's failed_task, failed_status and restart_cause: srun's lines about its
    tasks and its status -> the step's exit code and starts.jsonl's JSON. A dead rank's code
    and cause are its own even when its peer's 69 reached srun first; a silent rank's are
    the 69 of the peer that found it, naming the task srun killed."""
    functions = template_functions("failed_task", "failed_status", "restart_cause")
    (tmp_path / "errors").write_text(errors)
    script = f"""set -euo pipefail
FAILURE_RESTARTS=2
{exit_code_settings()}
{functions}
status=$(failed_status "$(failed_task "$1")" {srun_status})
echo "$status"
restart_cause 1 "$status" "$1"
"""
    out = subprocess.run(["bash", "-c", script, "-", str(tmp_path / "errors")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    code, recorded = out.split("\n", 1)
    assert int(code) == status
    assert json.loads(recorded) == json.loads(f'{{"restart": 1, "of": 2, {cause}}}')
