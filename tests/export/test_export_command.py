"""`belief-lm export` as users run it, and what it refuses before doing any work."""

import json

import pytest
from test_cli import belief_lm  # the CLI as a subprocess, as tests/test_cli.py runs it

from belief_lm.checkpoint.manifest import seal
from belief_lm.cli import main


def test_export_command_writes_a_transformers_folder(make_checkpoint, tmp_path):
    out = belief_lm(
        "export", "--checkpoint", str(make_checkpoint()), "--format", "hf",
        "--output", str(tmp_path / "hf"), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_belief_lm.BeliefLMForCausalLM"
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary left behind


def test_missing_checkpoint_exits_2_naming_it(tmp_path):
    out = belief_lm(
        "export", "--checkpoint", str(tmp_path / "step_000300"), "--format", "torch",
        "--output", str(tmp_path / "model.pt"), timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert f"checkpoint {tmp_path / 'step_000300'} does not exist" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "model.pt").exists()


def without(checkpoint, name):
    (checkpoint / name).unlink()
    return checkpoint


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda ck: without(ck, "run.json"), "is incomplete (no run.json)"),
        (lambda ck: without(ck, "mp_rank_00_model_states.pt"), "has no mp_rank_00_model_states.pt"),
        (lambda ck: without(ck, "tokenizer.model"), "has no tokenizer.model"),
        (
            lambda ck: (ck / "config.yaml").write_text("model: {atention: belief}"),
            "unusable config.yaml",
        ),
    ],
    ids=["no-run-json", "no-weights", "no-tokenizer", "bad-config"],
)
def test_incomplete_checkpoint_exits_2_naming_the_problem(
    make_checkpoint, tmp_path, capsys, damage, message
):
    checkpoint = make_checkpoint()
    damage(checkpoint)
    seal(checkpoint)  # as if saved so: the files agree with the manifest, the content is bad
    output = tmp_path / "hf"
    assert (
        main(["export", "--checkpoint", str(checkpoint), "--format", "hf", "--output", str(output)])
        == 2
    )
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_not_overwritten(make_checkpoint, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    args = ["export", "--checkpoint", str(make_checkpoint()), "--format", "hf"]
    assert main([*args, "--output", str(tmp_path / "hf")]) == 2
    assert "already exists" in capsys.readouterr().err
