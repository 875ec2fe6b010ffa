"""Damaged checkpoints of real training runs, at ZeRO 0 and 2 (in this process) and with a
pipeline (PP=2, two processes): a resume passes over every damaged one, with a warning
naming its file, to the newest intact one and continues exactly as the uninterrupted run;
a damaged checkpoint named explicitly is refused (exit 2) naming its file.

Each run saves at steps 2, 4, 6, 8 and 10; `damage.damage_all` then damages 10, 8, 6 and 4
one way each and garbles `latest`, so one resume meets every damage: pre-flight passes
over 10, 8 and 6 (sizes), the ranks' checksums over 4, and the run continues from 2.
"""

import logging
import shutil

import pytest

from belief_lm.checkpoint.files import CheckpointError, read_info
from belief_lm.checkpoint.verify import check_run
from belief_lm.config import load_config
from belief_lm.train.loop import train
from tests.checkpoint.damage import DAMAGES, copy_run, damage_all
from tests.jobs import MICRO, losses, run_cli

RUN = [
    "train.max_steps=10", "train.decay_steps=10", "checkpoint.interval=2",
    "checkpoint.keep=10", "data.num_workers=0",
]  # fmt: skip
LAYOUTS = {"zero0": ["parallel.zero_stage=0"], "zero2": ["parallel.zero_stage=2"]}


def config(run_dir, cache_dir, *overrides):
    return load_config(
        MICRO, [*RUN, f"run.output_dir={run_dir}", f"run.cache_dir={cache_dir}", *overrides]
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def trained(request, tmp_path_factory, cache_dir):
    """(layout overrides, run directory, losses) of an uninterrupted 10-step run."""
    layout = LAYOUTS[request.param]
    run_dir = tmp_path_factory.mktemp(request.param)
    result = train(config(run_dir, cache_dir, *layout))
    return layout, run_dir, result.losses


def test_resume_passes_over_every_damaged_checkpoint(trained, tmp_path, cache_dir, caplog):
    layout, run_dir, whole = trained
    run = copy_run(run_dir, tmp_path / "run")
    said = damage_all(run / "checkpoints")
    caplog.set_level(logging.WARNING, logger="belief_lm.checkpoint")
    resumed = train(config(run, cache_dir, *layout))
    assert list(resumed.losses) == list(range(3, 11))
    assert resumed.losses == {step: whole[step] for step in range(3, 11)}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("latest is unreadable" in w for w in warnings), warnings
    for name, message in said.items():
        assert any(name in w and message in w for w in warnings), (name, message, warnings)
    # the resumed run saved those steps again: every checkpoint is intact now
    check = check_run(run)
    assert [v.problems for v in check.verdicts] == [[]] * 5 and check.newest_intact


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_named_explicitly_is_refused(trained, tmp_path, cache_dir, damage):
    layout, run_dir, _ = trained
    step4 = tmp_path / "step_000004"
    shutil.copytree(run_dir / "checkpoints" / "step_000004", step4)
    message = DAMAGES[damage](step4)
    with pytest.raises(CheckpointError) as refused:
        train(config(tmp_path / "run", cache_dir, *layout, f"checkpoint.resume={step4}"))
    assert f"checkpoint {step4} is damaged" in str(refused.value)
    assert message in str(refused.value)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_checkpoint_verify_lists_every_checkpoint(trained, tmp_path):
    """`belief-lm checkpoint verify`: each checkpoint intact or damaged and why, the one a
    resume would take; exit 0 when the newest is intact, 2 when not. Sizes alone miss the
    changed byte."""
    _, run_dir, _ = trained
    intact = run_cli("checkpoint", "verify", str(run_dir), timeout=120)
    assert intact.returncode == 0, intact.stderr
    assert intact.stdout.count("  intact (") == 5 and "a resume would take step_000010" in (
        intact.stdout
    )
    run = copy_run(run_dir, tmp_path / "run")
    said = damage_all(run / "checkpoints")
    damaged = run_cli("checkpoint", "verify", str(run), timeout=120)
    assert damaged.returncode == 2, damaged.stderr
    lines = damaged.stdout.splitlines()
    for name, message in said.items():
        assert any(f"  {name}  damaged: " in line and message in line for line in lines)
    assert any(line.startswith("  step_000002  intact (") for line in lines)
    assert "latest" in damaged.stdout and "is unreadable" in damaged.stdout
    assert lines[-1] == (
        "newest checkpoint step_000010 is damaged; a resume would take step_000002"
    )
    sizes = run_cli("checkpoint", "verify", str(run / "checkpoints"), "--sizes-only")
    assert sizes.returncode == 2 and "  step_000004  intact (" in sizes.stdout
    empty = run_cli("checkpoint", "verify", str(tmp_path / "nothing"))
    assert empty.returncode == 2 and "no checkpoints" in empty.stdout


# With a pipeline: two processes, started by the command as a job would start them.

PIPELINE = ["parallel.pipeline=2", "parallel.zero_stage=1"]


def command(run_dir, cache_dir, *overrides) -> list[str]:
    return [
        "--config", MICRO, *RUN, *PIPELINE, f"run.output_dir={run_dir}",
        f"run.cache_dir={cache_dir}", *overrides,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory, cache_dir):
    """(run directory, losses) of an uninterrupted 10-step run at PP=2."""
    run_dir = tmp_path_factory.mktemp("pp2")
    done = run_cli("train", *command(run_dir, cache_dir), nproc=2, timeout=400)
    assert done.returncode == 0, done.stderr[-5000:]
    return run_dir, losses(run_dir)


@pytest.mark.slow
def test_pipeline_resume_passes_over_every_damaged_checkpoint(pipeline_run, tmp_path, cache_dir):
    run_dir, whole = pipeline_run
    run = copy_run(run_dir, tmp_path / "run")
    said = damage_all(run / "checkpoints")
    done = run_cli("train", *command(run, cache_dir), nproc=2, timeout=400)
    assert done.returncode == 0, done.stderr[-5000:]
    assert losses(run) == whole  # steps 1-2 from before, 3-10 again: the same
    assert read_info(run / "checkpoints" / "step_000010").step == 10
    assert "latest is unreadable" in done.stderr
    for name, message in said.items():
        assert f"{name} is damaged" in done.stderr and message in done.stderr, name


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_pipeline_damaged_checkpoint_named_explicitly_exits_2(
    pipeline_run, tmp_path, cache_dir, damage
):
    """`launch local` (whose exit code is its ranks'): pre-flight refuses a missing,
    truncated or unlisted file before starting the ranks; the ranks find the changed byte
    between them, and every rank exits 2."""
    run_dir, _ = pipeline_run
    step4 = tmp_path / "step_000004"
    shutil.copytree(run_dir / "checkpoints" / "step_000004", step4)
    message = DAMAGES[damage](step4)
    args = command(tmp_path / "run", cache_dir, f"checkpoint.resume={step4}")
    done = run_cli("launch", "local", *args, "launch.tasks_per_node=2", timeout=400)
    assert done.returncode == 2, done.stderr[-5000:]
    assert f"checkpoint {step4} is damaged" in done.stderr and message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["evaluate"],
        ["generate", "--prompt", "The", "--max-new-tokens", "2"],
        ["export", "--format", "torch", "--output", "OUT"],
    ],
    ids=["evaluate", "generate", "export"],
)
def test_commands_refuse_a_damaged_checkpoint(make_checkpoint, tmp_path, command):
    """evaluate, generate and export check every file against the manifest before reading
    a checkpoint: a changed byte is exit 2 naming the file, and nothing is written."""
    checkpoint = make_checkpoint()
    message = DAMAGES["byte-flipped"](checkpoint)
    args = [str(tmp_path / "out.pt") if a == "OUT" else a for a in command]
    done = run_cli(args[0], "--checkpoint", str(checkpoint), *args[1:], timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"checkpoint {checkpoint} is damaged" in done.stderr and message in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out.pt").exists()


def test_seal_gives_an_earlier_checkpoint_its_manifest(trained, tmp_path):
    """A checkpoint saved before manifests (none) is refused by a resume; `checkpoint
    seal` writes one from its files as they are, once."""
    _, run_dir, _ = trained
    step = tmp_path / "step_000004"
    shutil.copytree(run_dir / "checkpoints" / "step_000004", step)
    (step / "manifest.json").unlink()
    sealed = run_cli("checkpoint", "seal", str(step))
    assert sealed.returncode == 0 and f"sealed {step}: " in sealed.stdout, sealed.stderr
    assert check_run(tmp_path).newest_intact
    again = run_cli("checkpoint", "seal", str(step))
    assert again.returncode == 2 and "has a manifest already" in again.stderr
    missing = run_cli("checkpoint", "seal", str(tmp_path / "step_000009"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_a_run_directory_names_its_newest_intact_checkpoint(trained, tmp_path, caplog):
    """Commands that read one checkpoint (evaluate, generate, export) take a run directory
    or its checkpoints directory as the checkpoint a resume would take: damaged ones passed
    over with a warning, the one taken logged; none intact is an error saying so."""
    from belief_lm.checkpoint.consolidate import consolidate

    _, run_dir, _ = trained
    run = copy_run(run_dir, tmp_path / "run")
    DAMAGES["byte-flipped"](run / "checkpoints" / "step_000010")
    caplog.set_level(logging.INFO, logger="belief_lm.checkpoint")
    for given in (run, run / "checkpoints"):
        caplog.clear()
        taken = consolidate(given)
        assert taken.info.step == 8
        said = caplog.text
        assert "step_000010 is damaged" in said and f"{given}: its newest intact" in said
    for step in (2, 4, 6, 8):
        shutil.rmtree(run / "checkpoints" / f"step_{step:06d}")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*checkpoint verify"):
        consolidate(run)
