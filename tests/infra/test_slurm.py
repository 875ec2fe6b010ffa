"""slurm/pretrain.sbatch and `belief-lm launch slurm` on a real 2-node SLURM cluster
(tests/infra/slurm_cluster.sh: slurmctld + two slurmd in network namespaces)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import cli_command, losses, processes_mentioning

from .conftest import HERE, ROOT, TINY_RUN, job_env, logged_steps, run

pytestmark = pytest.mark.slow


def slurm(conf: Path, *command: str, timeout: float = 60) -> str:
    """stdout of a SLURM command against the test cluster."""
    return run(list(command), timeout=timeout, env=job_env(SLURM_CONF=str(conf))).stdout


def job_state(conf: Path, job_id: int) -> dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, Reason, ...). Asked
    again after a failure: on a loaded machine scontrol's connection to slurmctld
    sometimes breaks (SIGPIPE)."""
    command = ["scontrol", "show", "job", "--oneliner", str(job_id)]
    for attempt in range(3):
        out = subprocess.run(command, capture_output=True, text=True, timeout=60,
                             env=job_env(SLURM_CONF=str(conf)))  # fmt: skip
        if out.returncode == 0 or attempt == 2:
            break
        time.sleep(2)
    assert out.returncode == 0, f"scontrol exited {out.returncode}: {out.stderr}"
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait_for_job(conf: Path, job_id: int, timeout: float = 240) -> dict[str, str]:
    """Poll until the job has ended (after any requeues); its final state, with SLURM's
    own log lines about the job under "log" (what an assertion on the state shows)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(conf, job_id)
        if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return state | {"log": daemon_log(conf, job_id)}
        release_requeued(conf, job_id, state)
        time.sleep(1)
    subprocess.run(["scancel", str(job_id)], env=job_env(SLURM_CONF=str(conf)), check=False)
    pytest.fail(f"job {job_id} still {job_state(conf, job_id)['JobState']} after {timeout}s")


def release_requeued(conf: Path, job_id: int, state: dict[str, str]) -> None:
    """Start a requeued job now: SLURM holds one for 2 minutes, which a test need not wait
    out. Only once its previous run has ended on every node (none still completing it,
    its batch script's end reported): that report could otherwise be taken for the new
    run's. And not in the second its previous run's credential was revoked: slurmd refuses
    a credential made no later than the revocation, counted in whole seconds ("Job
    credential revoked"), and the job then fails instead of starting (seen in CI)."""
    if state["JobState"] != "PENDING" or state.get("Reason") != "BeginTime":
        return
    if not slurm(conf, "sinfo", "--noheader", "--states=completing", "--format=%N").strip():
        time.sleep(CREDENTIAL_CLOCK_SECONDS)
        slurm(conf, "scontrol", "update", f"JobId={job_id}", "StartTime=now")


CREDENTIAL_CLOCK_SECONDS = 2  # more than slurmd's one-second resolution of revocation times


def daemon_log(conf: Path, job_id: int) -> str:
    """slurmctld's and the slurmds' lines about a job (the cluster's logs beside its
    slurm.conf): why SLURM ended or requeued it, when each run's batch script ended."""
    pattern = re.compile(rf"(JobId={job_id}\b|job {job_id}\b|\[{job_id}\.)")
    lines = []
    for path in sorted((conf.parent / "log").glob("slurm*.log")):
        lines += [f"{path.stem}: {line}" for line in path.read_text().splitlines()
                  if pattern.search(line)]  # fmt: skip
    return "\n".join(lines)


def wait_for_text(path: Path, text: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count(text) >= count:
            return
        time.sleep(0.5)
    pytest.fail(f"{path} has not said {text!r} {count} times in {timeout}s")


def test_srun_tasks_know_their_place(slurm_cluster):
    """parallel.env.detect() in real srun tasks: one rank per node, master = first node."""
    out = slurm(
        slurm_cluster,
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--label",
        sys.executable,
        "-c",
        "from belief_lm.parallel.env import detect; e = detect(); "
        "print(e.launcher, e.rank, e.world_size, e.node_rank, e.local_rank, e.master_addr)",
        timeout=60,
    )
    assert sorted(out.split("\n")[:2]) == ["0: slurm 0 2 0 0 node1", "1: slurm 1 2 1 0 node1"]


def test_launch_slurm_trains_on_two_nodes(slurm_cluster, tmp_path, cache_dir):
    """`belief-lm launch slurm` renders and submits the template; 2 ranks on 2 nodes train."""
    submitted = run(
        cli_command(
            "launch",
            "slurm",
            *TINY_RUN,
            "launch.nodes=2",
            "launch.time_minutes=10",
            "launch.signal_seconds=60",
            f"run.output_dir={tmp_path}/run",
            f"run.cache_dir={cache_dir}",
        ),
        timeout=120,
        cwd=ROOT,
        env=job_env(SLURM_CONF=str(slurm_cluster)),
    ).stdout
    job_id = int(re.search(r"submitted job (\d+)", submitted)[1])
    state = wait_for_job(slurm_cluster, job_id)
    log = (tmp_path / f"run/slurm/belief-lm-tiny-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert state["NodeList"] == "node[1-2]" and state["NumTasks"] == "2"
    assert f"belief-lm: job {job_id} restart 0 on node[1-2]: 2 nodes, 2 tasks" in log
    # both tasks ran to the end (neither could without the other); rank 0 logged
    assert "belief-lm: training step exited with 0" in log
    assert re.search(r"^0: .*done: 4 steps", log, re.M)
    assert logged_steps(tmp_path / "run") == [2, 4]
    assert "nodes: 2\n" in (tmp_path / "run/config.yaml").read_text()
    assert (tmp_path / f"run/slurm/belief-lm-tiny-{job_id}.sbatch").is_file()


def test_sbatch_template_by_hand(slurm_cluster, tmp_path, cache_dir):
    """`sbatch [options] slurm/pretrain.sbatch --config ...`: the template as written."""
    # as after activating the virtualenv: the template's default command is `belief-lm`
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    out = run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            f"--output={tmp_path}/%j.out",
            str(ROOT / "slurm/pretrain.sbatch"),
            *TINY_RUN,
            f"run.output_dir={tmp_path}/run",
            f"run.cache_dir={cache_dir}",
        ],
        timeout=60,
        cwd=ROOT,
        env=job_env(SLURM_CONF=str(slurm_cluster), PATH=path),
    ).stdout
    job_id = int(out.strip())
    state = wait_for_job(slurm_cluster, job_id)
    log = (tmp_path / f"{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED", log[-3000:]
    assert logged_steps(tmp_path / "run") == [2, 4]


def submit_stand_in(conf: Path, tmp_path: Path, *options: str, **env: str) -> tuple[int, Path]:
    """The template with the stand-in trainer on 2 nodes (and sbatch `options`); waits
    until both tasks train."""
    job_id = int(
        run(
            [
                "sbatch",
                "--parsable",
                "--nodes=2",
                f"--output={tmp_path}/%j.out",
                *options,
                str(ROOT / "slurm/pretrain.sbatch"),
            ],
            timeout=60,
            env=job_env(SLURM_CONF=str(conf), BELIEF_LM=str(HERE / "stand_in_trainer.sh"), **env),
        ).stdout.strip()
    )
    log = tmp_path / f"{job_id}.out"
    wait_for_text(log, ": training", count=2)
    return job_id, log


def test_usr1_checkpoint_requeue_and_resume(slurm_cluster, tmp_path):
    """SIGUSR1 to the batch shell (as --signal=B:USR1@N sends it before the time limit)
    reaches every task; they exit 75 and the job requeues itself and runs again."""
    job_id, log = submit_stand_in(slurm_cluster, tmp_path)
    slurm(slurm_cluster, "scancel", "--batch", "--signal=USR1", str(job_id))
    state = wait_for_job(slurm_cluster, job_id)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", text + state["log"]
    assert text.count("SIGUSR1, checkpointed") == 2
    assert f"requeueing job {job_id}" in text
    assert f"job {job_id} restart 1 on node[1-2]" in text
    assert text.count("resumed at restart 1, finished") == 2


def test_time_limit_warning_to_the_tasks_checkpoints_and_requeues(slurm_cluster, tmp_path):
    """`--signal=USR1@N` without `B:`: SLURM itself signals the tasks (not the batch shell)
    N seconds before the time limit; they exit 75 and the job requeues itself."""
    # SLURM sends it at its first check of time limits (every 30 s) that finds under N s
    # left: 5 to 35 s into the job, long before the limit even on a loaded machine
    job_id, log = submit_stand_in(slurm_cluster, tmp_path, "--time=2", "--signal=USR1@115")
    state = wait_for_job(slurm_cluster, job_id)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", text + state["log"]
    assert text.count("SIGUSR1, checkpointed") == 2
    assert text.count("resumed at restart 1, finished") == 2


def test_requeue_stops_after_max_restarts(slurm_cluster, tmp_path):
    job_id, log = submit_stand_in(slurm_cluster, tmp_path, MAX_RESTARTS="0")
    slurm(slurm_cluster, "scancel", "--batch", "--signal=USR1", str(job_id))
    state = wait_for_job(slurm_cluster, job_id)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("FAILED", "75:0", "0")
    assert "(MAX_RESTARTS=0): not requeueing" in log.read_text()


def test_a_cancelled_job_is_not_requeued(slurm_cluster, tmp_path):
    """`scancel JOB` signals SIGTERM to every process of the job, as a stop does: the tasks
    exit 75 (or srun kills them), but a cancelled job stays cancelled (it was requeued)."""
    job_id, log = submit_stand_in(slurm_cluster, tmp_path)
    slurm(slurm_cluster, "scancel", str(job_id))
    state = wait_for_job(slurm_cluster, job_id)
    text = log.read_text()
    assert (state["JobState"], state["Restarts"]) == ("CANCELLED", "0"), text
    assert f"job {job_id} is COMPLETING (cancelled or out of time): not requeueing" in text


def submit_training(
    conf: Path, run_dir: Path, cache_dir: str, steps: int, *overrides: str, **env: str
) -> tuple[int, Path]:
    """The template by hand with the real trainer: 2 nodes, one data-parallel rank each
    (`overrides`: more config overrides; `env`: more variables for the job, e.g. the
    template's FAILURE_RESTARTS)."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    out = run(
        [
            "sbatch", "--parsable", "--nodes=2", f"--output={run_dir}.log",
            str(ROOT / "slurm/pretrain.sbatch"), *TINY_RUN, f"train.max_steps={steps}",
            "run.log_interval=1", f"checkpoint.interval={CHECKPOINT_INTERVAL}",
            f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", *overrides,
        ],
        timeout=60, cwd=ROOT, env=job_env(SLURM_CONF=str(conf), PATH=path, **env),
    ).stdout  # fmt: skip
    return int(out.strip()), Path(f"{run_dir}.log")


STEPS = 50  # long enough that a stop sent after step 5 lands mid-run on a loaded machine
CHECKPOINT_INTERVAL = 4  # what a stop that kills the tasks unsaved can lose


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory, cache_dir) -> dict[int, float]:
    """The losses of a whole run of STEPS steps on the 2 nodes."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    job_id, log = submit_training(slurm_cluster, run_dir, cache_dir, STEPS)
    assert wait_for_job(slurm_cluster, job_id)["JobState"] == "COMPLETED", log.read_text()[-3000:]
    return losses(run_dir)


def stop_mid_run(
    conf: Path, job_id: int, run_dir: Path, log: Path, rows: int = 5, *scancel: str
) -> None:
    """Once `rows` steps are logged (a requeued job released from its hold meanwhile),
    `scancel` with options `scancel` (default: SIGUSR1 to the batch shell, as
    --signal=B:USR1@N sends it before the time limit)."""
    metrics = run_dir / "metrics.jsonl"
    deadline, polls = time.monotonic() + 240, 0
    while not metrics.exists() or len(metrics.read_text().splitlines()) < rows:
        assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
        polls += 1
        if polls % 10 == 0:  # every 5 s
            release_requeued(conf, job_id, job_state(conf, job_id))
        time.sleep(0.5)
    slurm(conf, "scancel", *(scancel or ("--batch", "--signal=USR1")), str(job_id))


STOPPED = r"^0: .*stopped on request after step (\d+)"
"""Rank 0's report of a stop (every rank logs one)."""


def stopped_at(log: Path, count: int) -> int:
    """The step of the job's `count`-th stop (as rank 0 reports it; waiting for it)."""
    deadline = time.monotonic() + 120
    while len(steps := re.findall(STOPPED, log.read_text(), re.M)) < count:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return int(steps[count - 1])


def test_preempted_job_checkpoints_requeues_and_finishes_like_an_uninterrupted_one(
    slurm_cluster, tmp_path, cache_dir, uninterrupted
):
    """The real trainer, stopped three times mid-run: SIGUSR1 to every process of the job
    (batch shell, srun, the ranks and their loader workers: `scancel --full`), then SIGTERM to
    the ranks and their loader workers (`scancel --signal=TERM`, as a time limit or a
    preemption signal the tasks). Each time every rank finishes its step, they save it and
    exit 75, and the job requeues itself and resumes. Then SIGTERM to every process
    (`scancel --full --signal=TERM`): srun turns its copy into SIGKILL for the tasks, which
    cannot save; the batch shell requeues the job anyway and the run resumes from its last
    periodic checkpoint. The job's losses are the uninterrupted job's, bit for bit."""
    run_dir = tmp_path / "preempted"
    job_id, log = submit_training(slurm_cluster, run_dir, cache_dir, STEPS)
    stop_mid_run(slurm_cluster, job_id, run_dir, log, 5, "--full", "--signal=USR1")
    first = stopped_at(log, 1)
    stop_mid_run(slurm_cluster, job_id, run_dir, log, first + 3, "--signal=TERM")
    second = stopped_at(log, 2)
    # past the next periodic checkpoint, so the killed run has one to resume from
    killed_after = (second // CHECKPOINT_INTERVAL + 1) * CHECKPOINT_INTERVAL + 1
    stop_mid_run(slurm_cluster, job_id, run_dir, log, killed_after, "--full", "--signal=TERM")
    state = wait_for_job(slurm_cluster, job_id, timeout=400)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "3", text[-4000:]
    assert 5 <= first < second < killed_after < STEPS
    for step in (first, second):
        assert f"resuming after step {step}" in text
    assert "the tasks were killed before they could save (SIGTERM reached srun too)" in text
    resumes = [int(step) for step in re.findall(r"resuming after step (\d+)", text)]
    assert len(resumes) == 3 and second < resumes[2] < STEPS, text[-4000:]
    assert resumes[2] % CHECKPOINT_INTERVAL == 0  # a periodic checkpoint: nothing saved at the kill
    assert text.count(f"requeueing job {job_id}") == 3
    # the batch shell got the first and the third signal; each rank one of the first two
    shell_got = re.findall(r"^belief-lm: (SIG\w+): the tasks checkpoint", text, re.M)
    assert shell_got == ["SIGUSR1", "SIGTERM"]
    ranks_got = re.findall(r"^\d: belief-lm: (SIG\w+): finishing the step", text, re.M)
    assert sorted(ranks_got[:4]) == [
        "SIGTERM", "SIGTERM", "SIGUSR1", "SIGUSR1"
    ]  # fmt: skip
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # no step lost or repeated
    assert resumed == uninterrupted


def test_a_job_requeued_onto_fewer_nodes_continues_the_run(
    slurm_cluster, tmp_path, cache_dir, uninterrupted
):
    """The job starts on both nodes; stopped mid-run, its requeue is given one node (as a
    scheduler or a user does when nodes are down: `scontrol update NumNodes=1 NumTasks=1`). The
    template starts the trainer on what it got, which continues at data-parallel size 1
    (twice the gradient accumulation, the universal checkpoint) with the uninterrupted
    losses."""
    run_dir = tmp_path / "shrunk"
    job_id, log = submit_training(slurm_cluster, run_dir, cache_dir, STEPS)
    stop_mid_run(slurm_cluster, job_id, run_dir, log)
    deadline = time.monotonic() + 180
    while job_state(slurm_cluster, job_id)["JobState"] != "PENDING":  # requeued
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    slurm(slurm_cluster, "scontrol", "update", f"JobId={job_id}", "NumNodes=1", "NumTasks=1")
    state = wait_for_job(slurm_cluster, job_id, timeout=400)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", text[-4000:]
    assert f"job {job_id} restart 0 on node[1-2]: 2 nodes, 2 tasks" in text
    assert re.search(rf"job {job_id} restart 1 on node\d: 1 nodes, 1 tasks", text), text[-6000:]
    assert "layout TP1 x PP1 x DP1" in text
    stopped = int(re.search(STOPPED, text, re.M)[1])
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # no step lost or repeated
    # data-parallel size 1 sums the same gradients in another order, and where the gradient
    # is clipped the scale differs a little: fp32's differences grow over the steps after the
    # resume (1.5e-5 at the first, 4e-4 by step 50 in one run; the same windows, by the data
    # counts). A wrong window moves a step's loss by far more.
    for step in range(stopped + 1, STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-3), step


def kill_rank_one(run_dir: Path, log: Path, rows: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to task 1's trainer (on node2; the nodes share this machine's process ids)
    once `rows` steps are logged."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not metrics.exists() or len(metrics.read_text().splitlines()) < rows:
        assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
        time.sleep(0.2)
    mine = set(processes_mentioning(str(run_dir)))
    for pid in mine:
        proc = Path("/proc") / str(pid)
        parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        environ = (proc / "environ").read_bytes().split(b"\0")
        if parent not in mine and b"SLURM_PROCID=1" in environ:  # the rank, not its workers
            os.kill(pid, sig)
            return
    pytest.fail(f"no trainer of task 1 among {sorted(mine)}")


def test_a_dead_task_restarts_in_place_and_continues_like_an_uninterrupted_job(
    slurm_cluster, tmp_path, cache_dir, uninterrupted
):
    """FAILURE_RESTARTS=1 (launch.failure_restarts): task 1's trainer is SIGKILLed mid-run;
    srun names it in one line, task 0 exits quietly, and the template starts the tasks
    again in the same allocation (no requeue): they resume from the newest checkpoint, the
    job completes with the uninterrupted job's losses, and starts.jsonl records why."""
    run_dir = tmp_path / "restarted"
    job_id, log = submit_training(slurm_cluster, run_dir, cache_dir, STEPS, FAILURE_RESTARTS="1")
    kill_rank_one(run_dir, log, CHECKPOINT_INTERVAL + 2)
    state = wait_for_job(slurm_cluster, job_id, timeout=400)
    text = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "0", text[-4000:]
    assert re.search(r"^srun: error: node2: task 1: Killed$", text, re.M), text[-4000:]
    assert "belief-lm: training step exited with 137; restarting the tasks from the newest " \
        "checkpoint (failure restart 1 of 1)" in text  # fmt: skip
    assert "Traceback" not in text
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == uninterrupted
    starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]
    assert len(starts) == 2 and starts[1]["step"] % CHECKPOINT_INTERVAL == 0 < starts[1]["step"]
    assert starts[1]["restart"] == {
        "restart": 1, "of": 1, "cause": "rank died", "rank": 1, "host": "node2",
        "signal": "SIGKILL",
    }  # fmt: skip


def test_a_dead_task_without_failure_restarts_ends_the_job_with_its_code(
    slurm_cluster, tmp_path, cache_dir
):
    """The default (no failure restarts): the job fails with the dead task's code (137,
    SIGKILL), srun's line names it, and no traceback."""
    run_dir = tmp_path / "failed"
    job_id, log = submit_training(slurm_cluster, run_dir, cache_dir, STEPS)
    kill_rank_one(run_dir, log, 2)
    state = wait_for_job(slurm_cluster, job_id, timeout=300)
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("FAILED", "137:0", "0")
    assert re.search(r"^srun: error: node2: task 1: Killed$", text, re.M), text[-4000:]
    assert "belief-lm: training step exited with 137\n" in text and "restarting" not in text
    assert "Traceback" not in text


def test_a_silent_task_ends_the_job_as_a_lost_peer(slurm_cluster, tmp_path, cache_dir):
    """`kill -STOP` on task 1's trainer: task 0's collective times out after
    parallel.timeout_s and it exits 69 (peer lost); srun kills the silent task at the end
    of --wait (30 s). The job fails with 69, not the 137 of the task srun killed, within
    timeout_s + 30 s (+ a loaded machine's margin)."""
    run_dir = tmp_path / "silent"
    job_id, log = submit_training(
        slurm_cluster, run_dir, cache_dir, STEPS * 100, "parallel.timeout_s=15"
    )
    kill_rank_one(run_dir, log, 2, signal.SIGSTOP)
    stopped_at = time.monotonic()
    state = wait_for_job(slurm_cluster, job_id, timeout=300)
    took = time.monotonic() - stopped_at
    text = log.read_text()
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "69:0"), text[-4000:]
    assert 15 + 30 - 1 < took < 15 + 30 + 60, took
    assert re.search(r"^srun: error: node1: task 0: Exited with exit code 69$", text, re.M)
    assert "belief-lm: training step exited with 69\n" in text and "Traceback" not in text
