"""`belief-lm launch slurm|local`: the rendered sbatch script (--dry-run), its errors, and a
real 2-process torchrun."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from belief_lm.cli import main
from belief_lm.exit_codes import PREEMPTED
from launcher.slurm import TEMPLATE
from tests.jobs import run_cli

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


def test_template_requeues_on_the_launcher_exit_code():
    assert f"\nREQUEUE_EXIT_CODE={PREEMPTED}\n" in TEMPLATE.read_text()


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
    assert out.split() == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "belief_lm.cli",
        "train",
        "--config",
        "configs/tiny.yaml",
        "launch.tasks_per_node=2",
        "train.micro_batch_size=8",
    ]


def test_local_refuses_several_nodes(capsys):
    code, _, err = dry_run(capsys, "local", "launch.nodes=2", "train.micro_batch_size=8")
    assert code == 2 and "launch local runs on this machine only" in err


def test_submit_without_sbatch_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without SLURM's commands
    code = main(["launch", "slurm", "--config", "configs/tiny.yaml", f"run.output_dir={tmp_path}"])
    assert code == 1
    assert re.search(r"belief-lm: .*'sbatch'", capsys.readouterr().err)


@pytest.mark.slow
def test_launch_local_trains_with_two_processes(tmp_path, cache_dir):
    """torchrun really starts 2 CPU ranks (gloo) that train together."""
    out = run_cli(
        "launch", "local", "--config", "configs/tiny.yaml", "launch.tasks_per_node=2",
        "train.max_steps=3", "train.micro_batch_size=4", "train.global_batch_size=8",
        "model.num_layers=1", "run.log_interval=1", "run.tensorboard=false",
        f"run.output_dir={tmp_path}", f"run.cache_dir={cache_dir}", timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # torchrun started 2 processes, and exactly one of them logged each step: they formed
    # one world of 2 (two single-process runs would both be rank 0 and both write rows)
    assert "layout TP1 x PP1 x DP2" in out.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
