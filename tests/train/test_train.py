"""End-to-end training on the embedded corpus, in this process (world size 1)."""

import json
import math
import shutil
from importlib import metadata

import pytest
import yaml

from belief_lm.checkpoint.manifest import seal
from belief_lm.config import load_config
from belief_lm.train.loop import train
from belief_lm.variants import VARIANTS
from tests.jobs import MICRO


def small(tmp_path, cache_dir, *overrides):
    return load_config(
        MICRO,
        [
            "model.seq_length=64", "train.micro_batch_size=8", "train.max_steps=50",
            "train.decay_steps=null", "train.warmup_steps=5", f"run.output_dir={tmp_path}",
            f"run.cache_dir={cache_dir}", *overrides,
        ],
    )  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_learns(tmp_path, cache_dir, variant):
    result = train(small(tmp_path, cache_dir, f"model.attention={variant}"))
    losses = [result.losses[s] for s in range(1, 51)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(4096), abs=0.2)  # uniform at init
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 1.0, (first, last)


def test_run_directory_contents(tmp_path, cache_dir):
    cfg = small(
        tmp_path, cache_dir, "train.max_steps=4", "run.tensorboard=true", "run.log_interval=2"
    )
    train(cfg)
    assert load_config(tmp_path / "config.yaml") == cfg
    env = json.loads((tmp_path / "environment.json").read_text())
    assert env["packages"]["torch"] == metadata.version("torch") and env["packages"]["deepspeed"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(row)
        assert row["grad_norm"] > 0 and row["tokens_per_s"] > 0
        assert row["tflops_per_device"] > 0 and row["memory_gb"] > 0 and row["data_wait_s"] >= 0
        assert row["data/padding"] == 0  # steps of the epoch's bulk: every slot a full window
        assert row["data/documents_per_step"] >= 8  # each of a step's 8 windows its own
    assert (tmp_path / "tokenizer.model").stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4]
    assert [e.value for e in events.Scalars("train/data/padding")] == [0, 0]
    assert len(events.Scalars("train/data/documents_per_step")) == 2
    assert (
        yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["attention"]
        == "belief_star"
    )


def test_zero_stages_and_accumulation_agree(tmp_path, cache_dir):
    """Same data, same init: ZeRO 0-3 and 2 x 4-sequence micro-batches vs 1 x 8 give the
    same losses (fp32)."""
    runs = {}
    for name, overrides in {
        "zero0": ["parallel.zero_stage=0"],
        "zero1": ["parallel.zero_stage=1"],
        "zero2": ["parallel.zero_stage=2"],
        "zero3": ["parallel.zero_stage=3"],
        "accum2": ["parallel.zero_stage=1", "train.micro_batch_size=4"],
    }.items():
        cfg = small(tmp_path / name, cache_dir, "train.max_steps=6", *overrides)
        runs[name] = list(train(cfg).losses.values())
    for name, losses in runs.items():
        assert losses == pytest.approx(runs["zero1"], rel=1e-5, abs=1e-5), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.tensor=2"], "world size 1 is not divisible by parallel.tensor (2)"),
        (
            ["parallel.pipeline=3", "model.num_layers=2"],
            "parallel.pipeline (3) exceeds model.num_layers (2)",
        ),
        (["parallel.zero_stage=2", "parallel.pipeline=2"], "zero_stage=2 cannot be combined"),
        (["train.precision=bf16"], "train.precision=bf16 needs a GPU"),
        (["data.sources=[nowhere]"], "data.sources.0.uri: unknown data source 'nowhere'"),
        (["data.tokenizer.path=/does/not/exist.model"], "data.tokenizer.path: no such file"),
    ],
)
def test_bad_settings_fail_before_training(tmp_path, cache_dir, overrides, message):
    with pytest.raises(ValueError) as err:
        train(small(tmp_path, cache_dir, *overrides))
    assert message in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path, cache_dir):
    """Selective (attention core) and full (whole layer) recompute train exactly as storing
    everything does: the same losses and gradient norms at every step (fp32; the model's
    gradients, parameter by parameter and per variant: tests/model/test_gpt.py)."""
    runs = {}
    for mode in ("none", "selective", "full"):
        out = tmp_path / mode
        train(small(out, cache_dir, "train.max_steps=4", f"train.activation_checkpointing={mode}"))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = [(r["loss"], r["grad_norm"]) for r in rows]
    assert len(runs["none"]) == 4
    for mode in ("selective", "full"):
        for (loss, norm), (ref_loss, ref_norm) in zip(runs[mode], runs["none"], strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6), mode
            assert norm == pytest.approx(ref_norm, rel=1e-5), mode


def test_belief_diagnostics_logged(tmp_path, cache_dir):
    train(small(tmp_path, cache_dir, "train.max_steps=4", "run.diagnostics_interval=2"))
    rows = [json.loads(x) for x in (tmp_path / "diagnostics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for layer in (1, 2):
        assert 0 < rows[-1][f"layer{layer}/delta_over_mh"] <= 1 + 1e-6


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_validation_during_training_matches_evaluate(tmp_path, cache_dir, mask):
    """`evaluate` measures what validation measured during training: the same batches,
    under the attention mask the model was trained with."""
    from belief_lm.evaluate import evaluate

    result = train(
        small(
            tmp_path,
            cache_dir,
            "train.max_steps=4",
            "train.eval_interval=2",
            "train.eval_batches=3",
            f"model.attention_mask={mask}",
            "model.attention=attention_bn_sh",
        )
    )
    assert sorted(result.val_losses) == [2, 4]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    evaluated = evaluate(str(tmp_path / "checkpoints" / "step_000004"), max_batches=3)
    assert evaluated["loss"] == pytest.approx(result.val_losses[4], rel=1e-6)
    assert evaluated["tokens"] == 3 * 8 * 64
    if mask == "document":  # and not what the causal mask gives on the same weights
        causal = tmp_path / "causal"
        checkpoint = tmp_path / "checkpoints" / "step_000004"
        shutil.copytree(checkpoint, causal)
        config = (causal / "config.yaml").read_text()
        config = config.replace("attention_mask: document", "attention_mask: causal")
        (causal / "config.yaml").write_text(config)
        seal(causal)
        other = evaluate(str(causal), max_batches=3)
        assert other["loss"] != pytest.approx(evaluated["loss"], rel=1e-6)  # (as matched above)
