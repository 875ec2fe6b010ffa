"""Export a checkpoint as one torch file: whole fp32 weights, config and tokenizer.

    {"format": "belief-lm", "version": 1, "config": {...every run setting...},
     "info": {"step": ..., "vocab_size": ..., ...}, "state_dict": {BeliefLM name: tensor},
     "tokenizer_model": b"...sentencepiece model bytes..."}

Readable with torch.load(path, weights_only=True) (plain values and tensors only; `read`
loads it as a checkpoint's files are, belief_lm/checkpoint/loading.py); `load_model`
rebuilds BeliefLM from it,
and sentencepiece.SentencePieceProcessor(model_proto=obj["tokenizer_model"]) the tokenizer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import sentencepiece as spm
import torch

from belief_lm.checkpoint import loading
from belief_lm.checkpoint.consolidate import Consolidated, load_full_state
from belief_lm.config import Config
from belief_lm.errors import BadInput
from belief_lm.model.gpt import BeliefLM

FORMAT, VERSION = "belief-lm", 1


def export_torch(checkpoint: Consolidated, output: Path) -> None:
    """Write `checkpoint` as a single torch file at `output`."""
    torch.save(
        {
            "format": FORMAT,
            "version": VERSION,
            "config": checkpoint.config.model_dump(mode="json"),
            "info": dataclasses.asdict(checkpoint.info),
            "state_dict": checkpoint.state_dict,
            "tokenizer_model": checkpoint.tokenizer_path.read_bytes(),
        },
        output,
    )


def read(path: str | Path) -> dict:
    """The exported dict (tensors on CPU); BadInput if it is not a belief-lm export."""
    obj = loading.load(path, "cpu")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise BadInput(f"{path} is not a belief-lm torch export")
    return obj


def load_model(path: str | Path) -> BeliefLM:
    """BeliefLM (TP=1, eval, fp32) with the exported weights. Needs megatron's process
    groups, as any BeliefLM (belief_lm.parallel.grid.ProcessGrid.single_process)."""
    obj = read(path)
    config = Config.model_validate(obj["config"])
    eos_id = spm.SentencePieceProcessor(model_proto=obj["tokenizer_model"]).eos_id()
    model = BeliefLM(config.model, obj["info"]["vocab_size"], seed=config.run.seed, eos_id=eos_id)
    load_full_state(model, obj["state_dict"])
    return model.eval()
