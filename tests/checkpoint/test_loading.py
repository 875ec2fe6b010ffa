"""Loading never runs code (belief_lm/checkpoint/loading.py): a checkpoint file holding a
pickled payload, under a manifest resealed to match it (a CRC is no signature), is refused
by every command naming the file, and its payload never runs; the opt-in loads it; the
checkpoints belief-lm writes need nothing beyond the allow-list.

The payload is a `__reduce__` that writes a marker file when unpickled. One real checkpoint
(the session's `trained_checkpoint`, ZeRO-1) is copied and poisoned per test; the commands
run in this process."""

import logging
import shutil

import numpy as np
import pytest
import torch

from belief_lm.checkpoint import loading
from belief_lm.checkpoint.consolidate import consolidate
from belief_lm.checkpoint.files import read_info
from belief_lm.cli import main
from belief_lm.config import load_config
from belief_lm.preflight import ResumeFrom
from belief_lm.train import trainer_state
from tests.checkpoint.conftest import RUNS
from tests.checkpoint.damage import poison

KINDS = [
    "data_state.pt",
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "run_state/rank00000.pt",
]
"""Every torch file the trainer's one-process ZeRO-1 checkpoint holds."""


def copy_run(checkpoint, to):
    """A copy of `checkpoint`'s step directory in a run directory of its own; its path."""
    step = to / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, step)
    return step


def reseal(step) -> None:
    """A manifest matching the files as they are now, as `belief-lm checkpoint seal` writes."""
    (step / "manifest.json").unlink()
    assert main(["checkpoint", "seal", str(step)]) == 0


@pytest.fixture
def poisoned(trained_checkpoint, tmp_path):
    """Factory: a copy of the trained checkpoint with file `name` poisoned, resealed."""

    def make(name: str):
        step = copy_run(trained_checkpoint, tmp_path / "poisoned")
        poison(step / name, tmp_path / "marker")
        reseal(step)
        return step

    return make


def commands(step, tmp_path, docs) -> dict[str, list[str]]:
    """Every command that reads a checkpoint, on `step` (`docs`: its evaluation data)."""
    resume = [
        "train", "--config", str(step / "config.yaml"), f"run.output_dir={tmp_path / 'resumed'}",
        "--resume", str(step), "train.max_steps=4",
    ]  # fmt: skip
    export = ["export", "--checkpoint", str(step), "--format"]
    return {
        "train --resume": resume,
        "evaluate": ["evaluate", "--checkpoint", str(step), "--data", str(docs), "--batches", "1"],
        "generate": ["generate", "--checkpoint", str(step), "--prompt", "The"],
        "export torch": [*export, "torch", "--output", str(tmp_path / "out.pt")],
        "export hf": [*export, "hf", "--output", str(tmp_path / "hf")],
        "checkpoint verify": ["checkpoint", "verify", str(step.parent.parent)],
    }


READ_BY_EVERY_COMMAND = KINDS[1:3]
"""DeepSpeed's files; the data and RNG states only a resume reads (and verify checks)."""


@pytest.mark.parametrize("name", KINDS)
def test_no_command_runs_a_poisoned_file_and_each_that_reads_it_exits_2(
    trained_checkpoint, poisoned, name, tmp_path, capsys
):
    step = poisoned(name)
    marker = tmp_path / "marker"
    docs = trained_checkpoint.parents[2] / "docs.jsonl"  # the data it was trained on
    for command, argv in commands(step, tmp_path, docs).items():
        reads = name in READ_BY_EVERY_COMMAND or command in ("train --resume", "checkpoint verify")
        assert main(argv) == (2 if reads else 0), command
        said = capsys.readouterr()
        assert not marker.exists(), f"{command} ran the payload of {name}"
        assert "Traceback" not in said.err, command
        if reads:  # refused before any file is loaded: the checkpoint, naming the file
            where = "refused: " if command == "checkpoint verify" else f"checkpoint {step}: "
            assert f"{where}{name} asks to import builtins.exec" in said.out + said.err, command
    pytest.importorskip("lm_eval")  # the lm-eval model: an optional extra
    from belief_lm.inference.lm_eval_adapter import BeliefLMEval

    if name in READ_BY_EVERY_COMMAND:
        with pytest.raises(loading.RefusedFile, match=f"{name} asks to import builtins.exec"):
            BeliefLMEval(str(step))
    else:
        BeliefLMEval(str(step))
    assert not marker.exists(), f"lm-eval ran the payload of {name}"


def test_trusted_the_payload_runs(poisoned, tmp_path, caplog):
    """The opt-in is what it says (and the payload above is live): with --trust-checkpoint
    a poisoned file is loaded with pickle after a warning naming it, and its code runs."""
    step = poisoned("mp_rank_00_model_states.pt")
    caplog.set_level(logging.WARNING, logger="belief_lm.checkpoint")
    out = tmp_path / "model.pt"
    argv = ["export", "--checkpoint", str(step), "--format", "torch", "--output", str(out)]
    assert main([*argv, "--trust-checkpoint"]) == 0
    assert (tmp_path / "marker").read_text() == "ran"
    assert "mp_rank_00_model_states.pt asks to import builtins.exec" in caplog.text
    assert "loading it with pickle" in caplog.text


@pytest.mark.parametrize("name", KINDS)
def test_each_reader_refuses_the_file_it_loads(poisoned, name, tmp_path, single_process_group):
    """Without the check before loading (loading.refusals), the loads themselves refuse
    the file: the data and RNG states, consolidation's reads, and DeepSpeed's engine (a
    resume on the same layout loads through our checkpoint engine, writer.py)."""
    from tests.models import trainee_for

    step = poisoned(name)
    resume = ResumeFrom(step, read_info(step), other_layout=False)
    if name == "data_state.pt":
        reads = [lambda: trainer_state.load_data_state(resume)]
    elif name.startswith("run_state/"):
        reads = [lambda: trainer_state.load_rank_state(resume, 0)]
    else:
        cfg = load_config(step / "config.yaml", [f"run.output_dir={tmp_path / 'run'}"])
        engine = trainee_for(cfg, single_process_group, resume.info.vocab_size).engine
        trainer_state.checkpointer(cfg, engine, single_process_group)  # as training: before a load
        reads = [
            lambda: consolidate(step, verify=False),
            lambda: trainer_state.restore(resume, cfg, engine, single_process_group),
        ]
    for read in reads:
        with pytest.raises(loading.RefusedFile, match=f"{name} asks to import builtins.exec"):
            read()
    assert not (tmp_path / "marker").exists()


def test_a_checkpoint_holds_nothing_beyond_the_allow_list(trained_checkpoint):
    files = sorted(trained_checkpoint.rglob("*.pt"))
    assert [f.relative_to(trained_checkpoint).as_posix() for f in files] == sorted(KINDS)
    assert loading.refusals(trained_checkpoint) == []


def test_only_the_allow_list_counts(tmp_path):
    """megatron-core adds argparse.Namespace (and 15 more) to torch's list of safe types
    for the whole process when imported: a checkpoint file holding one is refused all the
    same, and torch's list is as it was afterwards."""
    import argparse

    before = set(torch.serialization.get_safe_globals())
    assert argparse.Namespace in before
    torch.save({"args": argparse.Namespace(lr=1.0)}, tmp_path / "args.pt")
    with pytest.raises(loading.RefusedFile, match=r"args\.pt asks to import argparse\.Namespace"):
        loading.load(tmp_path / "args.pt")
    assert set(torch.serialization.get_safe_globals()) == before


def legacy(step) -> None:
    """Make `step` what an earlier belief-lm saved: NumPy arrays in the data state and
    NumPy's own RNG state tuple in the rank state."""
    data = torch.load(step / "data_state.pt", weights_only=False)
    torch.save(trainer_state.tensors_as_arrays(data), step / "data_state.pt")
    rank = torch.load(step / "run_state/rank00000.pt", weights_only=False)
    saved = rank["rng"]["numpy"]
    key = saved["key"].numpy().astype(np.uint32)
    rank["rng"]["numpy"] = (saved["bit_generator"], key, saved["pos"], saved["has_gauss"],
                            saved["cached_gaussian"])  # fmt: skip
    torch.save(rank, step / "run_state/rank00000.pt")
    reseal(step)


def resume(step, run_dir, *options: str) -> int:
    """`belief-lm train` continuing the trained run to step 4 in `run_dir` (which holds
    `step`), in this process."""
    config = str(step / "config.yaml")
    return main(["train", "--config", config, f"run.output_dir={run_dir}", "train.max_steps=4",
                 *options])  # fmt: skip


def losses(run_dir) -> dict[int, float]:
    from belief_lm.report import read_jsonl

    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def hostile_inputs_resumed(trained_checkpoint, tmp_path_factory):
    """The trained run's directory copied, its other inputs garbled (each read as data:
    JSON, safe YAML), and resumed to step 4 (auto): the run directory and the exit code."""
    run = tmp_path_factory.mktemp("hostile") / "run"
    shutil.copytree(trained_checkpoint.parent.parent, run)
    (run / "environment.json").write_text('{"git_commit": ')
    with (run / "metrics.jsonl").open("a") as file:
        file.write('[1, 2]\n{"step": 9, "lo')  # not a row, and a row cut short
    with (run / "starts.jsonl").open("a") as file:
        file.write('{"step": 3, "ti')
    (run / "heartbeats").mkdir(exist_ok=True)
    (run / "heartbeats" / "rank_00000.json").write_text('["not", "a", "heartbeat"]')
    (run / "heartbeats" / "peer_lost.x.json").write_text('"nothing"')
    (run / "config.yaml").write_text("!!python/object/apply:builtins.exec ['1/0']\n")
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe step")
    return run, resume(trained_checkpoint, run)


def test_hostile_run_directory_inputs_are_rewritten_or_skipped(hostile_inputs_resumed):
    """A resume rewrites config.yaml and environment.json, drops the metrics rows that are
    none, warns about the unreadable `latest`, and goes on from the newest checkpoint."""
    import json

    from belief_lm.report import load_run

    run, code = hostile_inputs_resumed
    assert code == 0
    assert list(losses(run)) == [1, 2, 3, 4]
    json.loads((run / "environment.json").read_text())
    assert "python/object" not in (run / "config.yaml").read_text()
    report = load_run(run)  # the cut starts.jsonl line skipped (a warning)
    assert [s["step"] for s in report.starts] == [0, 3]


def test_an_earlier_belief_lms_checkpoint_needs_the_opt_in(
    trained_checkpoint, hostile_inputs_resumed, tmp_path, capsys, caplog
):
    """An earlier belief-lm saved NumPy objects in its data and RNG states: the resume is
    refused naming the file, the global and the opt-in; with it, the run continues exactly
    as from the same checkpoint saved now (a warning per file)."""
    step = copy_run(trained_checkpoint, tmp_path / "run")
    legacy(step)
    assert resume(step, tmp_path / "run") == 2
    said = capsys.readouterr().err
    assert "data_state.pt asks to import numpy." in said and "--trust-checkpoint" in said
    assert "run_state/rank00000.pt asks to import numpy." in said
    caplog.set_level(logging.WARNING, logger="belief_lm.checkpoint")
    assert resume(step, tmp_path / "run", "--trust-checkpoint") == 0
    assert "checkpoint.trust is on" in caplog.text
    assert "run_state/rank00000.pt asks to import numpy." in caplog.text
    now, _ = hostile_inputs_resumed
    assert losses(tmp_path / "run")[4] == losses(now)[4]


def test_a_checkpoints_config_yaml_is_read_as_data(trained_checkpoint, tmp_path, capsys):
    step = copy_run(trained_checkpoint, tmp_path / "run")
    marker = tmp_path / "marker"
    exploit = f"!!python/object/apply:builtins.exec [\"open({str(marker)!r}, 'w')\"]\n"
    (step / "config.yaml").write_text(exploit)
    reseal(step)
    export = ["export", "--checkpoint", str(step), "--format", "torch", "-o", str(tmp_path / "x")]
    assert main(export) == 2
    assert resume(trained_checkpoint, tmp_path / "run") == 2  # (the config is the trained one)
    said = capsys.readouterr().err
    assert said.count("config.yaml") >= 2 and "Traceback" not in said
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_every_layout_saves_nothing_beyond_the_allow_list(saved_layouts, name):
    """Every file of every checkpoint the trainer saved at ZeRO 0-3, with pipelines, with
    TP, in bf16 (tests/checkpoint/conftest.py's runs)."""
    steps = sorted((saved_layouts[name] / "checkpoints").glob("step_*"))
    assert steps
    for step in steps:
        assert any(step.rglob("*.pt")) and loading.refusals(step) == [], step
