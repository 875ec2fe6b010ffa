"""Pre-flight: every check that needs no work, for a job of a given size, without torch."""

import dataclasses
import json

import pytest
import yaml

from belief_lm.checkpoint.files import CheckpointError, CheckpointInfo
from belief_lm.checkpoint.manifest import seal
from belief_lm.cli import main
from belief_lm.config import load_config
from belief_lm.parallel.dims import ParallelDims
from belief_lm.preflight import preflight


def config(*overrides):
    return load_config("configs/tiny.yaml", list(overrides))


def test_a_good_layout_is_worked_out():
    plan = preflight(config("parallel.tensor=2", "train.micro_batch_size=2"), 8, "cuda")
    assert (plan.dims.tensor, plan.dims.pipeline, plan.dims.data) == (2, 1, 4)
    assert plan.grad_accumulation == 16 // (2 * 4)
    assert plan.bf16 is True and plan.resume is None
    assert preflight(config(), 1, "cpu").bf16 is False


def test_the_chunked_loss_runs_in_a_pipeline():
    """train.loss_chunk_tokens with pipeline parallelism (once refused): the loss_fn
    computes it from the output stage's hidden states and weight."""
    plan = preflight(config("parallel.pipeline=2", "train.loss_chunk_tokens=512"), 2)
    assert (plan.dims.pipeline, plan.dims.data) == (2, 1)


@pytest.mark.parametrize(
    ("world", "overrides", "message"),
    [
        (
            4,
            ["parallel.tensor=3", "parallel.sequence_parallel=false"],
            "world size 4 is not divisible by parallel.tensor (3)",
        ),
        (8, ["parallel.tensor=8"], "model.num_attention_heads (4) is not divisible by"),
        (4, ["parallel.tensor=4"], "query groups (num_query_groups) (2) is not divisible"),
        (2, ["train.micro_batch_size=16"], "must be a multiple of train.micro_batch_size (16)"),
        (2, ["train.micro_batch_size=16"], "micro-batch sizes that work here: 1, 2, 4, 8"),
        (
            3,
            ["train.global_batch_size=12", "train.micro_batch_size=1", "data.readers=4"],
            "must divide the run's 4 data readers (data.readers); data-parallel sizes that "
            "work: 1, 2, 4",
        ),
        (4, ["parallel.pipeline=2", "parallel.zero_stage=2"], "cannot be combined"),
        (8, ["parallel.pipeline=8"], "exceeds model.num_layers (4)"),
        (2, ["parallel.pipeline=2", "train.spike.action=skip"], "train.spike.action=skip cannot"),
        (1, ["model.compile=layer", "parallel.zero_stage=3"], "compile=layer cannot be combined"),
    ],
)
def test_bad_layouts_are_refused_naming_the_options(world, overrides, message):
    with pytest.raises(ValueError) as err:
        preflight(config(*overrides), world)
    assert message in str(err.value)


def test_launch_refuses_before_submitting(capsys):
    """The issue's example: 4 GPUs, PP=2 with ZeRO-2 would have been submitted and then
    refused by every rank at start-up."""
    args = ["launch.gpus_per_node=4", "parallel.pipeline=2", "parallel.zero_stage=2"]
    code = main(["launch", "slurm", "--dry-run", "--config", "configs/tiny.yaml", *args])
    assert code == 2
    assert "parallel.zero_stage=2 cannot be combined with parallel.pipeline=2" in (
        capsys.readouterr().err
    )


def test_launch_world_size_is_nodes_times_tasks():
    launch = config("launch.nodes=3", "launch.gpus_per_node=8").launch
    assert launch.world_size == 24
    assert config("launch.nodes=2", "launch.tasks_per_node=4").launch.world_size == 8


def test_config_checks_against_a_world_size(capsys):
    args = ["config", "--config", "configs/tiny.yaml", "parallel.tensor=2"]
    assert main(args) == 2  # the launch section's default world: one process
    assert "world size 1 is not divisible" in capsys.readouterr().err
    assert main([*args, "--world-size", "2"]) == 0


@pytest.mark.parametrize(
    "command",
    [
        ["train"],
        ["launch", "slurm", "--dry-run"],
        ["config"],
        ["plan", "--gpus", "8", "--gpu-memory-gb", "80"],
    ],
    ids=["train", "launch", "config", "plan"],
)
def test_a_sequence_that_tensor_parallelism_cannot_split_exits_2(command, capsys, tmp_path):
    """Sequence parallelism (on at TP > 1) splits each sequence over the tensor-parallel
    ranks: a sequence length that TP does not divide is refused by every command that reads
    a config, before any work, naming the keys and the sizes that would work."""
    run_dir = tmp_path / "run"
    args = ["--config", "configs/tiny.yaml", "parallel.tensor=4", "model.seq_length=130"]
    assert main([*command, *args, f"run.output_dir={run_dir}"]) == 2
    error = capsys.readouterr().err
    assert "model.seq_length (130) is not divisible by parallel.tensor (4)" in error
    sizes = "multiple of 4, parallel.tensor to one of [2], or parallel.sequence_parallel=false"
    assert sizes in error
    assert not run_dir.exists()


def fake_checkpoint(root, cfg, **layout):
    step = root / "checkpoints" / "step_000010"
    step.mkdir(parents=True)
    info = dict(step=10, consumed_tokens=0, tensor=1, pipeline=1, data=2, zero_stage=1)
    info = CheckpointInfo(**{**info, **layout, "vocab_size": 4096})
    (step / "run.json").write_text(json.dumps(dataclasses.asdict(info)))
    (step / "config.yaml").write_text(cfg.to_yaml())
    seal(step)
    return step


def test_the_checkpoint_a_resume_would_load_is_checked_up_front(tmp_path):
    run = [f"run.output_dir={tmp_path}"]
    step = fake_checkpoint(tmp_path, config(*run), zero_stage=3, tensor=2, data=1)
    plan = preflight(config(*run, "parallel.tensor=2", "parallel.zero_stage=3"), 2)
    assert plan.resume.path == step and not plan.resume.other_layout
    with pytest.raises(CheckpointError, match="ZeRO stage 1 or 2 on both sides"):
        preflight(config(*run, "parallel.zero_stage=3"), 1)  # ZeRO-3, another layout
    with pytest.raises(CheckpointError, match=r"different model config: model\.num_layers"):
        preflight(config(*run, "model.num_layers=2", "parallel.tensor=2"), 2)
    assert ParallelDims(6, 2, 3).data == 1


def test_a_checkpoint_saved_before_an_option_existed_resumes(tmp_path):
    """A config.yaml without an option added since (a source's hub_revision) is read with
    the option's default: the same run, not 'a different data config'."""
    cfg = config(f"run.output_dir={tmp_path}", "data.sources=[{uri: 'hf:a/b'}]")
    step = fake_checkpoint(tmp_path, cfg, data=1)
    saved = yaml.safe_load((step / "config.yaml").read_text())
    del saved["data"]["sources"][0]["hub_revision"]
    (step / "config.yaml").write_text(yaml.safe_dump(saved))
    seal(step)
    assert preflight(cfg, 1).resume.path == step
    with pytest.raises(CheckpointError, match=r"different data config: data\.sources"):
        preflight(config(f"run.output_dir={tmp_path}", "data.sources=[{uri: 'hf:a/c'}]"), 1)
