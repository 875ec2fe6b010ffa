"""Validation loss of a checkpoint, on any layout.

    belief-lm evaluate --checkpoint RUN/checkpoints/step_000300 [--data SOURCE] [--tensor N]
    torchrun --nproc_per_node=4 -m belief_lm.cli evaluate --checkpoint ... --tensor 2

The checkpoint is consolidated (whole weights, whatever layout saved it) and sharded onto
this job's TP x DP layout. The batches do not depend on the layout: every rank reads the
held-out stream as a single reader would and data-parallel ranks take every k-th batch.
Without --data: the held-out documents (data.validation_fraction) of the checkpoint's own
sources; with --data: every document of that source.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from belief_lm.checkpoint.consolidate import consolidate, load_full_state
from belief_lm.errors import BadInput
from belief_lm.model.gpt import BeliefLM
from belief_lm.parallel import env as process_env
from belief_lm.parallel.dims import ParallelDims
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.runtime import select_device
from belief_lm.train.validation import validation_batches, validation_loss
from data_pipeline.config import SourceConfig
from data_pipeline.tokenizer import Tokenizer


def evaluate(
    checkpoint: str,
    data_source: str | None = None,
    tensor: int = 1,
    max_batches: int = 50,
    micro_batch_size: int | None = None,
    device: str = "auto",
    trust: bool = False,
) -> dict:
    """{'loss', 'perplexity', 'tokens', 'batches', 'step', ...}, the same on every rank.
    `trust`: see consolidate."""
    env = process_env.detect()
    torch_device = select_device(device, env.local_rank)
    grid = ProcessGrid.join(env, torch_device, ParallelDims(env.world_size, tensor, 1))
    layout = grid.layout
    # every rank reads the files: no conversion, no collective
    ckpt = consolidate(checkpoint, trust=trust)
    cfg = ckpt.config
    data = cfg.data
    if data_source is not None:  # a dedicated evaluation source: all of its documents
        data = data.model_copy(
            update={"sources": [SourceConfig(uri=data_source)], "validation_fraction": 1.0}
        )
    micro = micro_batch_size or cfg.train.micro_batch_size
    tokenizer = Tokenizer(ckpt.tokenizer_path)
    batches = validation_batches(
        data, tokenizer, cfg.model.seq_length, micro, layout, torch_device, max_batches
    )
    model = BeliefLM(
        cfg.model, ckpt.info.vocab_size, layout.tensor, seed=cfg.run.seed, eos_id=tokenizer.eos_id
    )  # the documents, under model.attention_mask=document, as in training
    load_full_state(model, ckpt.state_dict)
    loss, tokens = validation_loss(model.to(torch_device), batches, grid.data_group)
    if tokens == 0:
        raise BadInput(
            f"no validation data for {checkpoint} (data: {[s.uri for s in data.sources]})"
        )
    return {
        "checkpoint": str(ckpt.path),
        "step": ckpt.info.step,
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": tokens,
        "sources": [s.uri for s in data.sources],
        "layout": {"tensor": layout.tensor, "data": layout.data},
    }


def write_report(result: dict, output: str | Path | None = None) -> str | None:
    """The result as JSON text on rank 0 (also written to `output` if given); None on the
    other ranks, which computed the same result."""
    if process_env.detect().rank != 0:
        return None
    text = json.dumps(result, indent=2)
    if output is not None:
        Path(output).write_text(text + "\n")
    return text
