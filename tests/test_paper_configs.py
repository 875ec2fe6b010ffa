"""The paper-run configs load, and start on CPU with a tiny override: everything but the
model size, the data source (the hub is unreachable here) and the precision is theirs."""

from pathlib import Path

import pytest

from belief_lm.config import load_config
from belief_lm.preflight import preflight
from belief_lm.train.loop import train

PAPER = sorted(Path("configs/paper").glob("*.yaml"))


def test_there_are_softmax_and_belief_star_runs_of_both_papers():
    names = {p.stem for p in PAPER}
    assert names == {
        "gpt2-124m-owt", "gpt2-124m-owt-belief_star",
        "llama-188m-fineweb-edu", "llama-188m-fineweb-edu-belief_star",
        "llama-1b-fineweb-edu", "llama-1b-fineweb-edu-belief_star",
    }  # fmt: skip


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_config_passes_preflight_on_every_allocation(path):
    """`launch slurm` would submit it: every world size its launch section allows (the 1B
    runs: 1 to 4 nodes of 8 GPUs) has a layout, batch and readers that work."""
    cfg = load_config(path, ["checkpoint.resume=never"])
    for world_size in cfg.launch.world_sizes:
        plan = preflight(cfg, world_size, "cuda")
        assert plan.bf16 and plan.dims.data == world_size


@pytest.mark.parametrize("path", PAPER, ids=lambda p: p.stem)
def test_paper_config_starts_on_cpu(path, tmp_path, cache_dir):
    paper = load_config(path)
    micro = paper.train.micro_batch_size
    cfg = load_config(
        path,
        [
            "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
            f"model.num_query_groups={2 if paper.model.num_query_groups else 'null'}",
            "model.ffn_hidden_size=128", "model.seq_length=32", "data.sources=[embedded]",
            "data.tokenizer.vocab_size=4096", "data.num_workers=0", "train.precision=fp32",
            f"train.global_batch_tokens={micro * 32}", "train.max_steps=2",
            "train.eval_interval=2", "train.eval_batches=1", f"run.output_dir={tmp_path}",
            f"run.cache_dir={cache_dir}", "run.tensorboard=false", "run.log_interval=1",
        ],
    )  # fmt: skip
    assert cfg.train.lr == paper.train.lr and cfg.model.attention == paper.model.attention
    result = train(cfg)
    assert set(result.losses) == {1, 2} and set(result.val_losses) == {2}
