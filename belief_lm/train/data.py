"""From the data config to batches: sources, tokenizer, this rank's window stream."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from belief_lm.config import DataConfig
from data_pipeline.documents import Document
from data_pipeline.sources import open_source
from data_pipeline.stream import PackedWindows
from data_pipeline.tokenizer import Tokenizer, cached_tokenizer


def check_sources(data: DataConfig) -> None:
    """Fail before any work if a source cannot be used."""
    if len(data.sources) != 1:
        raise ValueError(
            f"data.sources lists {len(data.sources)} sources; weighted mixtures are not "
            "implemented yet, give exactly one"
        )
    for i, source in enumerate(data.sources):
        try:
            open_source(source.uri)
        except ValueError as err:
            raise ValueError(f"data.sources.{i}.uri: {err}") from None


def documents(data: DataConfig) -> list[Document]:
    return list(open_source(data.sources[0].uri))


def build_tokenizer(data: DataConfig, cache_dir: str) -> Tokenizer:
    """The configured tokenizer, or one trained on the sources (rank 0 trains and caches
    it while the other ranks wait, then everyone loads the cached file)."""
    if data.tokenizer.path is not None:
        path = Path(data.tokenizer.path).expanduser()
        if not path.is_file():
            raise ValueError(f"data.tokenizer.path: no such file: {path}")
        return Tokenizer(path)
    key = [s.uri for s in data.sources]
    first = not dist.is_initialized() or dist.get_rank() == 0
    tokenizer = None
    if first:
        texts = (d.text for d in documents(data))
        tokenizer = cached_tokenizer(key, texts, data.tokenizer.vocab_size, cache_dir)
    if dist.is_initialized():
        dist.barrier()
    return tokenizer or cached_tokenizer(key, (), data.tokenizer.vocab_size, cache_dir)


def batches(
    stream: PackedWindows, micro_batch_size: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) micro-batches, [micro_batch, seq] each, on `device`."""
    loader = torch.utils.data.DataLoader(stream, batch_size=micro_batch_size, num_workers=0)
    for windows in loader:
        windows = windows.to(device, non_blocking=True)
        yield windows[:, :-1], windows[:, 1:]


def train_stream(
    data: DataConfig, tokenizer: Tokenizer, seq_len: int, rank: int, world_size: int
) -> PackedWindows:
    return PackedWindows(
        documents(data),
        tokenizer,
        seq_len,
        split="train",
        validation_fraction=data.validation_fraction,
        seed=data.seed,
        rank=rank,
        world_size=world_size,
    )
