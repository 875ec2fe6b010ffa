"""A real checkpoint: a few steps of `belief-lm train`'s training loop on a tiny model."""

import json
from pydoc_data.topics import topics

import pytest

from belief_lm.config import load_config
from tests.jobs import MICRO


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory, small_tokenizer, single_process_group):
    from belief_lm.train.loop import train

    root = tmp_path_factory.mktemp("trained")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": topics[k]}) + "\n" for k in sorted(topics)))
    cfg = load_config(
        MICRO,
        [
            "model.hidden_size=32", "model.ffn_hidden_size=64", "train.micro_batch_size=4",
            "train.global_batch_size=4", "train.max_steps=3", "train.warmup_steps=1",
            f"data.sources=[{docs}]", f"data.tokenizer.path={small_tokenizer.path}",
            "data.num_workers=0", f"run.output_dir={root / 'run'}",
        ],
    )  # fmt: skip
    train(cfg)
    return root / "run" / "checkpoints" / "step_000003"
