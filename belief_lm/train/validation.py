"""Validation loss on held-out batches that do not depend on the layout.

Every rank reads the held-out stream as a single reader would and data-parallel rank r
takes batches r, r + DP, ...: the same batches whatever the TP/PP/DP split, so runs on
different layouts (and `belief-lm evaluate` afterwards) measure the same thing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from belief_lm.model.loss import IGNORE_INDEX
from belief_lm.parallel.collectives import collective_device
from belief_lm.parallel.dims import Layout
from belief_lm.train.engine import label_weights
from data_pipeline.build import build_validation_data
from data_pipeline.config import DataConfig
from data_pipeline.tokenizer import Tokenizer

Batch = tuple[torch.Tensor, torch.Tensor]


def validation_batches(
    data: DataConfig,
    tokenizer: Tokenizer,
    seq_len: int,
    micro_batch_size: int,
    layout: Layout,
    device: torch.device,
    max_batches: int,
) -> list[Batch]:
    """This data-parallel rank's share of up to `max_batches` x DP held-out micro-batches."""
    batches = build_validation_data(
        data, tokenizer, seq_len, micro_batch_size, device, max_batches * layout.data
    )
    return batches[layout.data_rank :: layout.data]


@torch.no_grad()
def validation_loss(
    model_or_engine,
    batches: list[Batch],
    data_group: dist.ProcessGroup | None,
    pipelined: bool = False,
) -> tuple[float, int]:
    """Mean next-token loss over every label of the batches of every rank of `data_group`
    (the grid's data-parallel group; None: this process's alone), weighted by tokens as
    training's (padded windows count for their labels only), and the number of labels
    (collective over the group; the model is left in training mode)."""

    module = model_or_engine.module if hasattr(model_or_engine, "module") else model_or_engine
    was_training = module.training
    module.eval()
    totals = torch.zeros(2, dtype=torch.float64)  # summed loss x tokens, tokens (on the host)
    try:
        if pipelined and batches:  # DeepSpeed runs the micro-batches through the stages
            labels = [labels for _, labels in batches]
            # its average over micro-batches and data parallelism: the token mean of all
            module.label_weights = list(label_weights(model_or_engine, labels))
            loss = model_or_engine.eval_batch(iter(batches), num_micro_batches=len(batches))
            tokens = sum(int((part != IGNORE_INDEX).sum()) for part in labels)
            totals += torch.tensor([float(loss) * tokens, tokens], dtype=torch.float64)
        else:
            for tokens, labels in batches:
                count = int((labels != IGNORE_INDEX).sum())
                totals[0] += float(module(tokens, labels)) * count
                totals[1] += count
    finally:
        module.train(was_training)
    if data_group is not None:
        reduced = totals.to(collective_device(data_group))
        dist.all_reduce(reduced, group=data_group)
        totals = reduced.cpu()
    if totals[1] == 0:
        return float("nan"), 0
    return float(totals[0] / totals[1]), int(totals[1])
