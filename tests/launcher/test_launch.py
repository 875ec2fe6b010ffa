"""`belief-lm launch slurm|local`: the rendered sbatch script (--dry-run), its errors, and
2 real ranks started by `launch local`, stopped by signals as clusters deliver them."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from belief_lm import exit_codes
from belief_lm.checkpoint.files import newest_checkpoint, read_info
from belief_lm.cli import main
from belief_lm.exit_codes import PREEMPTED
from belief_lm.train.loop import train
from launcher.slurm import TEMPLATE, exit_code_settings
from tests.jobs import (
    MICRO,
    losses,
    metrics,
    processes_mentioning,
    start_cli,
    wait_for_rows,
)

GPU_RUN = [
    "launch.nodes=4",
    "launch.gpus_per_node=8",
    "launch.partition=gpu",
    "launch.account=proj42",
    "launch.time_minutes=240",
    "launch.signal_seconds=600",
    "launch.cpus_per_task=12",
    "launch.sbatch_options=[--qos=high, --exclusive]",
    "launch.env={NCCL_SOCKET_IFNAME: ib0, NOTE: two words}",
    "train.global_batch_size=512",
    "run.output_dir=runs/big",
]


def dry_run(capsys, target, *overrides):
    code = main(["launch", target, "--dry-run", "--config", "configs/tiny.yaml", *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


def sbatch_lines(script):
    return [
        line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")
    ]


def test_gpu_job_script(capsys):
    code, script, _ = dry_run(capsys, "slurm", *GPU_RUN)
    assert code == 0
    assert sbatch_lines(script) == [
        "--job-name=belief-lm-tiny",
        "--nodes=4",
        "--ntasks-per-node=8",  # one task per GPU
        "--gpus-per-node=8",
        "--cpus-per-task=12",
        "--partition=gpu",
        "--account=proj42",
        "--time=240",
        "--signal=B:USR1@600",
        "--requeue",
        "--open-mode=append",
        "--output=runs/big/slurm/%x-%j.out",
        "--qos=high",
        "--exclusive",
    ]
    settings = script.split("# >>> settings")[1].split("# <<< settings")[0]
    assert f"BELIEF_LM={Path(sys.executable).with_name('belief-lm')}\n" in settings
    # the arguments the job passes to `belief-lm train`: the same config and overrides
    assert "TRAIN_ARGS=(--config configs/tiny.yaml launch.nodes=4 " in settings
    assert "'launch.env={NCCL_SOCKET_IFNAME: ib0, NOTE: two words}'" in settings
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport NOTE='two words'\n" in settings
    assert "CONTAINER_IMAGE=''\n" in settings
    # the body is the template's, unchanged
    body = TEMPLATE.read_text().split("# <<< settings\n")[1]
    assert script.endswith(body)


def test_cpu_job_with_container_and_no_signal(capsys):
    code, script, _ = dry_run(
        capsys,
        "slurm",
        "launch.nodes=2",
        "launch.signal_seconds=0",
        "launch.job_name=ci",
        "launch.log_dir=/logs",
        "launch.container_image=registry#belief-lm:latest",
        "launch.container_mounts=[/data:/data, /scratch:/scratch]",
        "train.micro_batch_size=8",
    )
    assert code == 0
    assert sbatch_lines(script) == [
        "--job-name=ci",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--time=60",
        "--requeue",
        "--open-mode=append",
        "--output=/logs/%x-%j.out",
    ]
    assert "BELIEF_LM=belief-lm\n" in script  # the image's command
    assert "CONTAINER_IMAGE='registry#belief-lm:latest'\n" in script
    assert "CONTAINER_MOUNTS=/data:/data,/scratch:/scratch\n" in script


@pytest.mark.parametrize("extra", [[], ["launch.container_image=img", "launch.signal_seconds=0"]])
def test_rendered_script_passes_shellcheck(capsys, tmp_path, extra):
    _, script, _ = dry_run(capsys, "slurm", *GPU_RUN, *extra)
    (tmp_path / "job.sbatch").write_text(script)
    out = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True)
    assert out.returncode == 0, out.stderr
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.skip("needs shellcheck (bash setup.sh --dev)")
    out = subprocess.run([shellcheck, str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_the_job_script_has_the_trainers_exit_codes(capsys, monkeypatch):
    """The template, which also runs as written (`sbatch slurm/pretrain.sbatch`), holds
    belief_lm.exit_codes' codes; `launch slurm` writes them from there."""
    assert exit_code_settings() in TEMPLATE.read_text()
    assert f"\nREQUEUE_EXIT_CODE={PREEMPTED} " in TEMPLATE.read_text()
    monkeypatch.setattr(exit_codes, "PREEMPTED", 99)
    monkeypatch.setattr(exit_codes, "NOT_RESTARTED", (0, 2, 3, 99))
    _, script, _ = dry_run(capsys, "slurm")
    assert "\nREQUEUE_EXIT_CODE=99 " in script and "\nNOT_RESTARTED=(0 2 3 99) " in script


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launch.nodes=0"], "launch.nodes = 0: Input should be greater than 0"),
        (
            ["launch.time_minutes=5"],
            "signal_seconds (300) must be shorter than time_minutes (5 min)",
        ),
        (["launch.partition=gpu a100"], "'gpu a100' must be one word without quotes"),
        (["launch.env={1BAD: x}"], "'1BAD' is not an environment variable name"),
        (
            ["launch.nodes=3"],
            "train.global_batch_size (16) must be a multiple of train.micro_batch_size (16) "
            "x data-parallel size (3)",
        ),
    ],
)
def test_bad_launch_settings_exit_2(capsys, overrides, message):
    code, out, err = dry_run(capsys, "slurm", *overrides)
    assert code == 2 and out == ""
    assert message in err


def test_local_command(capsys):
    code, out, _ = dry_run(capsys, "local", "launch.tasks_per_node=2", "train.micro_batch_size=8")
    assert code == 0
    lines = [line.split() for line in out.splitlines()]
    command = [
        sys.executable, "-m", "belief_lm.cli", "train", "--config", "configs/tiny.yaml",
        "launch.tasks_per_node=2", "train.micro_batch_size=8",
    ]  # fmt: skip
    port = lines[0][3].removeprefix("MASTER_PORT=")
    for rank, line in enumerate(lines):
        assert line == [
            "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}",
            f"RANK={rank}", f"LOCAL_RANK={rank}", *command,
        ]  # fmt: skip
    assert len(lines) == 2 and port.isdigit()


def test_local_refuses_several_nodes(capsys):
    code, _, err = dry_run(capsys, "local", "launch.nodes=2", "train.micro_batch_size=8")
    assert code == 2 and "launch local runs on this machine only" in err


def test_submit_without_sbatch_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without SLURM's commands
    code = main(["launch", "slurm", "--config", "configs/tiny.yaml", f"run.output_dir={tmp_path}"])
    assert code == 1
    assert re.search(r"belief-lm: .*'sbatch'", capsys.readouterr().err)


def children(pid: int) -> dict[int, int]:
    """The processes `pid` started, by their RANK variable."""
    ranks = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                environ = (proc / "environ").read_bytes().split(b"\0")
                rank = next(v for v in environ if v.startswith(b"RANK="))
                ranks[int(rank.removeprefix(b"RANK="))] = int(proc.name)
        except (OSError, StopIteration):
            continue
    return ranks


@pytest.mark.slow
def test_launch_local_stops_however_signalled_and_continues_like_one_process(tmp_path, tiny_config):
    """2 ranks with 2 loader workers each, started by `launch local`, stopped mid-run:
    1. SIGUSR1 to rank 1 alone: both ranks save the same step, the launcher exits 75;
    2. SIGTERM to every process of the job (launcher, ranks, loader workers: the process
       groups of the launcher and of each rank), as SLURM's scancel delivers it: 75 again;
    3. the launcher SIGKILLed: its ranks still stop, save and end (no orphans).
    Resumed each time, the steps trained are those of one uninterrupted process (the same
    global batches at any data-parallel size)."""
    run_dir, steps = tmp_path / "launched", 40
    overrides = [
        f"train.max_steps={steps}", f"train.decay_steps={steps}", "data.num_workers=2",
        f"run.cache_dir={tiny_config().run.cache_dir}",
    ]  # fmt: skip
    log = (tmp_path / "log").open("w")

    def launch():
        args = ["launch", "local", "--config", MICRO, "launch.tasks_per_node=2"]
        return start_cli(*args, f"run.output_dir={run_dir}", *overrides, stderr=log,
                         start_new_session=True)  # fmt: skip

    def stopped_by(signal_it, job) -> int:
        """Two more steps, then `signal_it(job)`; once every process of the job has ended
        (none may outlive the launcher), its exit code."""
        logged = len(metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0
        wait_for_rows(run_dir, logged + 2, job)
        signal_it(job)
        code = job.wait(timeout=120)
        deadline = time.monotonic() + 60
        while processes_mentioning(str(run_dir)):
            assert time.monotonic() < deadline, "processes outlived the launcher"
            time.sleep(0.2)
        checkpoint = newest_checkpoint(run_dir / "checkpoints")
        assert len(list((checkpoint / "run_state").iterdir())) == 2  # both ranks saved it
        assert max(losses(run_dir)) == read_info(checkpoint).step < steps
        return code

    def one_rank(job):
        os.kill(children(job.pid)[1], signal.SIGUSR1)

    def process_group(job):
        ranks = children(job.pid).values()
        for group in (job.pid, *ranks):  # each rank leads a process group of its own
            os.killpg(group, signal.SIGTERM)

    def launcher_killed(job):
        job.kill()

    try:
        assert stopped_by(one_rank, launch()) == PREEMPTED
        assert stopped_by(process_group, launch()) == PREEMPTED
        stopped_by(launcher_killed, launch())
    finally:
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, signal.SIGKILL)
    text = (tmp_path / "log").read_text()
    assert "layout TP1 x PP1 x DP2" in text and text.count("exiting with 75") == 6
    # one world of 2 each time: exactly one of the processes logged each step
    trained = losses(run_dir)
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, max(trained) + 1))
    alone = train(tiny_config(*overrides, f"run.output_dir={tmp_path / 'alone'}"))
    assert trained == pytest.approx({s: alone.losses[s] for s in trained}, rel=1e-5)


@pytest.mark.parametrize("target", ["local", "slurm"])
def test_launch_branch_starts_ranks_from_the_checkpoints_config(
    capsys, tmp_path, trained_checkpoint, target
):
    """`launch local|slurm --branch CKPT`: without --config the checkpoint's config.yaml is
    the base (checked before anything starts), and every rank's `train` gets it with
    checkpoint.branch and resume=auto; a branch that changes the model is refused before
    any rank starts or any job is queued (exit 2, naming the key)."""
    branch = [f"run.output_dir={tmp_path / 'branch'}", "train.max_steps=6"]
    code = main(["launch", target, "--dry-run", "--branch", str(trained_checkpoint), *branch])
    out = capsys.readouterr().out
    assert code == 0
    assert f"--config {trained_checkpoint / 'config.yaml'}" in out
    for override in (f"checkpoint.branch={trained_checkpoint}", "checkpoint.resume=auto", *branch):
        assert override in out, override
    changed = [*branch, "model.num_layers=3"]
    code = main(["launch", target, "--dry-run", "--branch", str(trained_checkpoint), *changed])
    out, err = capsys.readouterr()
    assert code == exit_codes.BAD_INPUT and out == ""
    assert "model.num_layers (checkpoint: 2, now: 3)" in err, err
