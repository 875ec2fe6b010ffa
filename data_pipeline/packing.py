"""Packing token ids into fixed windows.

Documents are concatenated with EOS after each and cut into non-overlapping windows of
seq_len + 1 tokens (inputs are window[:-1], labels window[1:]), so every token lands in
exactly one window. What does not fill a window is carried into the next; the carry is
the packer's whole state.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


class WindowPacker:
    """Accumulates token ids and emits full windows of `window` tokens."""

    def __init__(self, window: int):
        if window < 2:
            raise ValueError(f"window must hold at least 2 tokens, got {window}")
        self.window = window
        self.carry = np.empty(0, dtype=np.int32)

    def add(self, ids: np.ndarray) -> Iterator[np.ndarray]:
        """Append `ids`; yield every window that is now complete.

        A window leaves the carry before it is yielded, so at every yield the carry holds
        exactly the tokens not yet emitted: a state_dict taken there loses nothing.
        """
        tokens = np.concatenate([self.carry, np.asarray(ids, dtype=np.int32)])
        self.carry = tokens
        for start in range(0, len(tokens) - self.window + 1, self.window):
            self.carry = tokens[start + self.window :]
            yield tokens[start : start + self.window]

    def state_dict(self) -> dict:
        # a tensor, not an array: the loader's state then loads with torch.load(weights_only=True)
        # (the trainer's rank state also holds numpy RNG state and loads with weights_only=False)
        return {"carry": torch.from_numpy(self.carry.copy())}

    def load_state_dict(self, state: dict) -> None:
        self.carry = np.asarray(state["carry"], dtype=np.int32)
