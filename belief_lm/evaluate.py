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

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from belief_lm.checkpoint.consolidate import Consolidated, consolidate, load_full_state
from belief_lm.config import SourceConfig
from belief_lm.model.gpt import BeliefLM
from belief_lm.parallel.setup import init_distributed, init_model_parallel
from belief_lm.runtime import select_device
from belief_lm.train.data import build_validation_data
from data_pipeline.tokenizer import Tokenizer
from launcher import env as launcher_env


def evaluate(
    checkpoint: str,
    data_source: str | None = None,
    tensor: int = 1,
    max_batches: int = 50,
    micro_batch_size: int | None = None,
    device: str = "auto",
) -> dict:
    """{'loss', 'perplexity', 'tokens', 'batches', 'step', ...}, the same on every rank."""
    env = launcher_env.detect()
    torch_device = select_device(device, env.local_rank)
    init_distributed(env, torch_device)
    layout = init_model_parallel(tensor, 1)
    ckpt = _consolidate_once(checkpoint)
    cfg = ckpt.config
    data = cfg.data
    if data_source is not None:  # a dedicated evaluation source: all of its documents
        data = data.model_copy(
            update={"sources": [SourceConfig(uri=data_source)], "validation_fraction": 1.0}
        )
    micro = micro_batch_size or cfg.train.micro_batch_size
    tokenizer = Tokenizer(ckpt.tokenizer_path)
    batches = build_validation_data(
        data, tokenizer, cfg.model.seq_length, micro, 0, 1, torch_device,
        max_batches * layout.data,
    )[layout.data_rank :: layout.data]  # fmt: skip
    model = BeliefLM(cfg.model, ckpt.info.vocab_size, layout.tensor, seed=cfg.run.seed)
    load_full_state(model, ckpt.state_dict)
    model.to(torch_device).eval()

    totals = torch.zeros(2, dtype=torch.float64)  # summed loss x tokens, tokens
    with torch.no_grad():
        for tokens, labels in batches:
            totals[0] += float(model(tokens, labels)) * labels.numel()
            totals[1] += labels.numel()
    dist.all_reduce(totals, group=ps.get_data_parallel_group())
    if totals[1] == 0:
        raise ValueError(
            f"no validation data for {checkpoint} (data: {[s.uri for s in data.sources]})"
        )
    loss = float(totals[0] / totals[1])
    return {
        "checkpoint": str(ckpt.path),
        "step": ckpt.info.step,
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": int(totals[1]),
        "sources": [s.uri for s in data.sources],
        "layout": {"tensor": layout.tensor, "data": layout.data},
    }


def _consolidate_once(checkpoint: str) -> Consolidated:
    """Rank 0 first (it may convert the checkpoint to the universal form), then the rest."""
    result = consolidate(checkpoint) if dist.get_rank() == 0 else None
    dist.barrier()
    return result or consolidate(checkpoint)
