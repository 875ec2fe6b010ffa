"""A checkpoint as a ready model in this process: BeliefLM at TP=1 plus its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from belief_lm.checkpoint.consolidate import Consolidated, consolidate
from belief_lm.model.gpt import BeliefLM
from data_pipeline.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A trained model, its tokenizer and where it came from."""

    model: BeliefLM
    tokenizer: Tokenizer
    checkpoint: Consolidated

    @property
    def context_length(self) -> int:
        """Tokens the model sees at once (model.seq_length)."""
        return self.checkpoint.config.model.seq_length


def single_process_groups() -> None:
    """megatron's layers need process groups even in one process: a gloo group of world
    size 1 (unless this process is already in one) and megatron's TP=PP=1 groups.

    The group has an in-memory store (no port to find) and skips DeepSpeed's start-up,
    which builds its CPU communication op every time (seconds to a minute here).
    """
    import torch.distributed as dist

    from belief_lm.parallel.setup import init_model_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_model_parallel(1, 1)


def resolve_device(name: str) -> torch.device:
    """'auto' is cuda when there is a GPU, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def load_model(checkpoint: str | Path, device: str = "auto") -> LoadedModel:
    """Consolidate `checkpoint` (a step directory) and build its model in eval mode (fp32)."""
    consolidated = consolidate(checkpoint)
    single_process_groups()
    model = consolidated.build_model().to(resolve_device(device))
    return LoadedModel(model, Tokenizer(consolidated.tokenizer_path), consolidated)
