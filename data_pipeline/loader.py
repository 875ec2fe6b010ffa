"""Micro-batches for the trainer: a StatefulDataLoader over MixedWindows, resumable exactly."""

from __future__ import annotations

from collections import Counter

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from data_pipeline.documents import SKIP_REASONS
from data_pipeline.stream import MixedWindows

SNAPSHOT_EVERY = 16
"""Batches between the workers' state snapshots. A snapshot per batch costs a worker 5-10%
of its time; a restore replays the batches since the last snapshot, so it stays exact."""


class TrainData:
    """Endless (tokens, labels) micro-batches, int64 [micro_batch, seq_len] each, on `device`.

    Windows are read and tokenized in `num_workers` DataLoader processes (each its own
    stream); batches come from the workers in turn. torchdata's StatefulDataLoader snapshots
    every worker's MixedWindows state every SNAPSHOT_EVERY batches and counts the batches
    handed out since, so `load_state_dict(state_dict())` continues with exactly the next
    batch despite prefetching. A state belongs to one data-parallel rank and one layout (`layout`:
    ranks, workers, window, seed, sources): documents are dealt to streams by that layout,
    so loading it under another is refused.
    """

    def __init__(
        self,
        dataset: MixedWindows,
        micro_batch_size: int,
        num_workers: int,
        device: torch.device,
        layout: dict,
    ):
        self.device, self.layout = device, dict(layout)
        self.loader = StatefulDataLoader(
            dataset,
            batch_size=micro_batch_size,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
            snapshot_every_n_steps=SNAPSHOT_EVERY,
        )
        self._batches = None

    def __iter__(self) -> TrainData:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = iter(self.loader)
        windows = next(self._batches).to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"layout": dict(self.layout), "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("layout", {})
        for key, value in self.layout.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"data state was saved with {key}={saved.get(key)!r}, this run has "
                    f"{key}={value!r}: the stream cannot resume exactly under another layout"
                )
        self.loader.load_state_dict(state["loader"])
        self._batches = None  # the next batch comes from a loader started at the state

    def stats(self) -> dict[str, float]:
        """Rows read, documents used, rows skipped (and why), tokens, over this rank's
        workers, as of their last state snapshot (at most SNAPSHOT_EVERY batches ago)."""
        counts = Counter()
        for state in worker_states(self.loader.state_dict()):
            counts.update(state["counts"] if state else {})
        skipped = sum(counts[r] for r in SKIP_REASONS)
        return {"skipped": float(skipped), **{k: float(v) for k, v in counts.items()}}


def worker_states(loader_state: dict) -> list[dict | None]:
    """Every worker's dataset state inside a StatefulDataLoader state (laid out differently
    with and without worker processes)."""
    if "_snapshot" in loader_state:
        snapshots = loader_state["_snapshot"]["_worker_snapshots"]
        return [snapshot["dataset_state"] for snapshot in snapshots.values()]
    return [loader_state.get("dataset_state")]
