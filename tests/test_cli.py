"""The `belief-lm` command as users run it (a subprocess, with a timeout)."""

import json
import math

import pytest

from tests.jobs import run_cli as belief_lm


def test_train_command(tmp_path, cache_dir):
    out = belief_lm(
        "train",
        "--config",
        "configs/tiny.yaml",
        "train.max_steps=5",
        "run.log_interval=5",
        "model.num_layers=1",
        f"run.output_dir={tmp_path}",
        f"run.cache_dir={cache_dir}",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 5 steps" in out.stderr
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5]
    # stdout of evaluate is the JSON alone, whatever the libraries print
    out = belief_lm("evaluate", "--checkpoint", str(tmp_path / "checkpoints" / "step_000005"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["step"] == 5 and result["tokens"] > 0
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model.atention=belief"], "model.atention: unknown key (did you mean 'attention'?)"),
        (["train.max_steps=0"], "train.max_steps = 0: Input should be greater than 0"),
        (
            ["parallel.tensor=3", "parallel.sequence_parallel=false"],
            "world size 1 is not divisible by parallel.tensor (3)",
        ),
    ],
)
def test_bad_config_exits_2_before_any_work(tmp_path, args, message):
    out = belief_lm(
        "train", "--config", "configs/tiny.yaml", f"run.output_dir={tmp_path}/run", *args
    )
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_config_command_prints_the_effective_config():
    out = belief_lm("config", "--config", "configs/tiny.yaml", "model.attention=belief")
    assert out.returncode == 0
    assert "attention: belief\n" in out.stdout and "num_layers: 4\n" in out.stdout


def test_evaluate_refuses_config_overrides():
    out = belief_lm("evaluate", "--checkpoint", "x", "model.seq_length=5")
    assert out.returncode == 2
    assert "unrecognized arguments: model.seq_length=5" in out.stderr


@pytest.mark.parametrize("checkpoint", ["missing", "incomplete"])
def test_evaluate_refuses_a_bad_checkpoint(tmp_path, checkpoint):
    path = tmp_path / "step_000010"
    if checkpoint == "incomplete":
        path.mkdir()
    out = belief_lm("evaluate", "--checkpoint", str(path))
    assert out.returncode == 2
    expected = "does not exist" if checkpoint == "missing" else "incomplete (no run.json)"
    assert expected in out.stderr and "Traceback" not in out.stderr
