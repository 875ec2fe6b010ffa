"""The training stream: documents -> tokens -> packed windows, for one data-parallel rank.

Documents are visited in a seeded random order per epoch (the epoch is part of the seed),
sharded round-robin over data-parallel ranks, filtered to the requested split by a hash of
their id, tokenized and packed. The stream's position (epoch, documents consumed, packer
carry) is a state_dict, so a restored stream continues with exactly the next window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from data_pipeline.documents import Document, split_of
from data_pipeline.packing import WindowPacker
from data_pipeline.tokenizer import Tokenizer


class PackedWindows(torch.utils.data.IterableDataset):
    """Endless windows of seq_len + 1 token ids (int64) from in-memory documents."""

    def __init__(
        self,
        documents: Sequence[Document],
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        split: str = "train",
        validation_fraction: float = 0.0,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        repeat: bool = True,
    ):
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        self.documents = [d for d in documents if split_of(d.id, validation_fraction) == split]
        if not self.documents:
            raise ValueError(f"no {split} documents (validation_fraction={validation_fraction})")
        self.tokenizer, self.seed, self.repeat = tokenizer, seed, repeat
        self.rank, self.world_size = rank, world_size
        self.packer = WindowPacker(seq_len + 1)
        self.epoch, self.consumed = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.documents))
        return order[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            order = self._order(self.epoch)
            while self.consumed < len(order):
                doc = self.documents[order[self.consumed]]
                self.consumed += 1
                ids = self.tokenizer.encode(doc.text)
                ids.append(self.tokenizer.eos_id)
                for window in self.packer.add(ids):
                    yield torch.from_numpy(window)
            if not self.repeat:
                return
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "packer": self.packer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = state["epoch"], state["consumed"]
        self.packer.load_state_dict(state["packer"])
