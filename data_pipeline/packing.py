"""Packing token ids into fixed windows.

Documents are concatenated with EOS after each and cut into non-overlapping windows of
seq_len + 1 tokens (inputs are window[:-1], labels window[1:]), so every token lands in
exactly one window. What does not fill a window is carried into the next; the carry is
the packer's whole state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class WindowPacker:
    """Accumulates token ids and emits full windows of `window` tokens."""

    def __init__(self, window: int):
        if window < 2:
            raise ValueError(f"window must hold at least 2 tokens, got {window}")
        self.window = window
        self._carry: list[int] = []

    def add(self, ids: Iterable[int]) -> Iterator[np.ndarray]:
        """Append `ids`; yield every window that is now complete.

        A window leaves the carry before it is yielded, so at every yield the carry holds
        exactly the tokens not yet emitted: a state_dict taken there loses nothing.
        """
        self._carry.extend(ids)
        while len(self._carry) >= self.window:
            window = np.asarray(self._carry[: self.window], dtype=np.int64)
            del self._carry[: self.window]
            yield window

    def state_dict(self) -> dict:
        return {"carry": list(self._carry)}

    def load_state_dict(self, state: dict) -> None:
        self._carry = list(state["carry"])
