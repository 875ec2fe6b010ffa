"""train.eval_tasks: refused before any work when they cannot run, and a failing
evaluation stops the run with lm-eval's error. (Runs that evaluate tasks on multi-rank
checkpoints, and their scores: tests/checkpoint/test_consumers.py.)"""

import subprocess
import sys
from pathlib import Path

import pytest

from belief_lm.cli import main
from belief_lm.config import ConfigError
from belief_lm.train.downstream import scalars
from belief_lm.train.loop import train
from tests.checkpoint.conftest import write_ppl_task
from tests.jobs import MICRO, ROOT, job_env


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.eval_tasks_interval=4", "checkpoint.interval=3"],
            r"train.eval_tasks_interval \(4\) must be a multiple of checkpoint.interval \(3\)",
        ),
        (["train.eval_tasks_interval=4"], r"checkpoint.interval \(0\)"),
        (["checkpoint.save_at_end=false"], "checkpoint.save_at_end is false"),
    ],
)
def test_tasks_must_run_at_a_checkpoint_step(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config("train.eval_tasks=[hellaswag]", *overrides)


def test_without_lm_eval_the_config_is_refused_naming_the_extra():
    block = "import sys; sys.modules['lm_eval'] = None; from belief_lm.cli import main; "
    done = subprocess.run(
        [sys.executable, "-c", block + "sys.exit(main(sys.argv[1:]))",
         "config", "--config", MICRO, "train.eval_tasks=[hellaswag]"],
        cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "train.eval_tasks needs lm-evaluation-harness" in done.stderr
    assert "pip install 'belief-lm[eval]'" in done.stderr


def test_training_without_tasks_needs_no_lm_eval():
    block = "import sys; sys.modules['lm_eval'] = None; import belief_lm.train.loop"
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=ROOT, env=job_env(), capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_missing_task_file_is_refused(tmp_path, capsys):
    task = tmp_path / "nowhere.yaml"
    assert main(["config", "--config", MICRO, f"train.eval_tasks=[{task}]"]) == 2
    assert f"train.eval_tasks: task file {task} does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_an_unknown_task_stops_the_run_before_any_work(tiny_config, single_process_group):
    cfg = tiny_config("train.eval_tasks=[no_such_task]")
    with pytest.raises(ValueError, match="lm-eval knows no task 'no_such_task'"):
        train(cfg)
    assert not Path(cfg.run.output_dir).exists()


@pytest.mark.slow
def test_a_failing_evaluation_stops_the_run_with_its_error(
    tiny_config, tmp_path, single_process_group
):
    task = write_ppl_task(tmp_path / "tasks")
    (tmp_path / "tasks" / "ppl.jsonl").unlink()  # the task's data: lm-eval fails to load it
    cfg = tiny_config(f"train.eval_tasks=[{task}]", "train.max_steps=1")
    with pytest.raises(RuntimeError, match=r"train.eval_tasks on \S+step_000001 failed") as err:
        train(cfg)
    assert "ppl.jsonl" in str(err.value)  # lm-eval's own message, from its process
    assert (Path(cfg.run.output_dir) / "checkpoints" / "step_000001" / "run.json").is_file()


def test_scores_are_the_metrics_by_task_and_filter():
    results = {
        "arc": {"alias": "arc", "sample_len": 4, "acc,none": 0.5, "acc_stderr,none": 0.1},
        "gsm": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A"},
    }
    assert scalars(results) == {"arc/acc": 0.5, "gsm/exact_match/strict-match": 0.25}
