"""Every command that reads a checkpoint, each in a fresh process, on real multi-rank
checkpoints (TP=2 x PP=2 with ZeRO-1, TP=2 x DP=2 with ZeRO-3): evaluate, export (torch and
Hugging Face), generate, and lm-eval (the downstream tasks the runs evaluated while
training); the torch export also on every other layout those tests save. References: the
validation loss the training layout computed on its live engine, and BeliefLM built here
from the consolidated checkpoint ("ours")."""

import json
import math

import pytest
import torch

from belief_lm.checkpoint.consolidate import consolidate
from belief_lm.checkpoint.files import read_info
from belief_lm.export.torch_file import load_model
from belief_lm.inference.generate import Sampling, generate
from data_pipeline.tokenizer import Tokenizer
from tests.checkpoint.conftest import PPL_DOCS, RUNS, STEPS, WITH_TASKS, checkpoint, metrics
from tests.jobs import run_cli

pytestmark = pytest.mark.slow
with_tasks = pytest.mark.parametrize("name", WITH_TASKS)
OTHER_LAYOUTS = [name for name in RUNS if name not in WITH_TASKS]
"""Every other layout the checkpoint tests save, for the torch export in a fresh process."""
SEQ = 32  # configs/test/micro.yaml's model.seq_length


def ours(run_dir, step: int = STEPS):
    """The checkpoint's model and tokenizer, built in this process."""
    consolidated = consolidate(checkpoint(run_dir, step))
    return consolidated.build_model(), Tokenizer(consolidated.tokenizer_path)


def cli(*args: str):
    done = run_cli(*args, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def probe(tokenizer: Tokenizer) -> torch.Tensor:
    """Two sequences of random token ids."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, tokenizer.vocab_size, (2, SEQ), generator=generator)


@with_tasks
def test_the_consumed_checkpoints_were_trained_with_sequence_parallelism(saved_layouts, name):
    """What the tests below read: checkpoints trained with parallel.sequence_parallel on
    (issue 33: evaluate, export, generate and its KV cache from such a checkpoint)."""
    config = consolidate(checkpoint(saved_layouts[name])).config
    assert config.parallel.tensor == 2 and config.parallel.sequence_parallel_on


@with_tasks
def test_evaluate_equals_the_training_layouts_validation_loss(saved_layouts, name, tmp_path):
    run = saved_layouts[name]
    (validated,) = [row for row in metrics(run) if "val_loss" in row]
    # the same held-out batches: 2 per data-parallel rank there, all of them here
    batches = 2 * read_info(checkpoint(run)).data
    out = tmp_path / "eval.json"
    cli("evaluate", "--checkpoint", str(checkpoint(run)), "--batches", str(batches), "-o", str(out))
    result = json.loads(out.read_text())
    assert result["step"] == validated["step"] == STEPS
    assert result["tokens"] == validated["val_tokens"]
    assert result["loss"] == pytest.approx(validated["val_loss"], rel=1e-6)


@with_tasks
def test_torch_export_computes_ours(saved_layouts, name, single_process_group, tmp_path):
    export_computes_ours(saved_layouts[name], tmp_path)


@pytest.mark.parametrize("name", OTHER_LAYOUTS)
def test_torch_export_of_other_layouts_computes_ours(
    saved_layouts, name, single_process_group, tmp_path
):
    export_computes_ours(saved_layouts[name], tmp_path)


def export_computes_ours(run, tmp_path) -> None:
    """`belief-lm export --format torch` of the run's checkpoint, in a fresh process, gives
    our model's logits exactly."""
    cli("export", "--checkpoint", str(checkpoint(run)), "--format", "torch",
        "--output", str(tmp_path / "model.pt"))  # fmt: skip
    model, tokenizer = ours(run)
    ids = probe(tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(
            load_model(tmp_path / "model.pt")(ids), model(ids), rtol=0, atol=0
        )


@with_tasks
def test_hf_export_computes_ours(saved_layouts, name, single_process_group, tmp_path):
    from transformers import AutoModelForCausalLM

    cli("export", "--checkpoint", str(checkpoint(saved_layouts[name])), "--format", "hf",
        "--output", str(tmp_path / "hf"))  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    model, tokenizer = ours(saved_layouts[name])
    ids = probe(tokenizer)
    with torch.no_grad():
        expected = model(ids).transpose(0, 1)
        torch.testing.assert_close(hf(ids).logits, expected, rtol=1e-5, atol=1e-5)


@with_tasks
def test_generate_continues_as_ours(saved_layouts, name, single_process_group):
    prompt = "The for statement"
    done = cli("generate", "--checkpoint", str(checkpoint(saved_layouts[name])), "--prompt",
               prompt, "--max-new-tokens", "12", "--temperature", "0")  # fmt: skip
    model, tokenizer = ours(saved_layouts[name])
    ids = tokenizer.encode(prompt)
    settings = {"context_length": SEQ, "vocab_size": tokenizer.vocab_size}
    settings["eos_id"] = tokenizer.eos_id
    decoded = [
        generate(model, ids, 12, Sampling(temperature=0), **settings, use_cache=cached)
        for cached in (True, False)
    ]
    assert decoded[0] == decoded[1]  # the KV cache's continuation is the recomputed one
    assert done.stdout == tokenizer.decode(ids + decoded[0]) + "\n"


def bits_per_byte(model, tokenizer) -> float:
    """lm-eval's bits_per_byte of PPL_DOCS computed directly: each document scored after
    EOS in one window, -sum(log p) / bytes / ln 2."""
    logp_total, size = 0.0, 0
    for text in PPL_DOCS:
        ids = tokenizer.encode(text)
        assert len(ids) <= SEQ
        with torch.no_grad():
            logits = model(torch.tensor([[tokenizer.eos_id, *ids[:-1]]]))[:, 0]
        logp = logits.double().log_softmax(-1)
        logp_total += float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum())
        size += len(text.encode())
    return -logp_total / size / math.log(2)


@with_tasks
def test_downstream_tasks_ran_on_the_checkpoints_during_training(
    saved_layouts, name, single_process_group
):
    """lm-eval in a fresh process on each checkpoint it was due on (every 3 steps, or at the
    end): its scores in metrics.jsonl equal a direct computation with our model."""
    run = saved_layouts[name]
    rows = {row["step"]: row for row in metrics(run) if "tiny_ppl/bits_per_byte" in row}
    assert list(rows) == ([3, 6] if name == "tp2-pp2-zero1" else [6])
    for step, row in rows.items():
        assert row["tiny_ppl/bits_per_byte"] == pytest.approx(
            bits_per_byte(*ours(run, step)), rel=1e-5
        )
        assert (run / "downstream" / f"step_{step:06d}.json").is_file()  # lm-eval's results
    if name == "tp2-pp2-zero1":  # the run that writes tensorboard events
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(run / "tensorboard")).Reload()
        scalars = events.Tags()["scalars"]
        assert {"downstream/tiny_ppl/bits_per_byte", "val/val_loss"} <= set(scalars)
        logged = events.Scalars("downstream/tiny_ppl/bits_per_byte")
        assert [e.step for e in logged] == list(rows)
        expected = [row["tiny_ppl/bits_per_byte"] for row in rows.values()]
        assert [e.value for e in logged] == pytest.approx(expected, rel=1e-6)
