"""The console's view of a run on rank 0: step, loss, tokens/s, MFU and the run's ETA.

On a terminal a tqdm bar, updated at each log (the run's other log lines print above it);
when the output is not a terminal (SLURM, a pipe, a file), one plain log line per log
interval instead, which reads well in a job log. Every scalar goes to the metrics sinks
either way; this is only what a person watching sees.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("belief_lm.train")


class Progress:
    """Progress of a run from step `start` to `total`, written to `stream` (stderr)."""

    def __init__(self, total: int, start: int, stream: TextIO | None = None):
        stream = sys.stderr if stream is None else stream
        self.total, self.start = total, start
        self.started = time.perf_counter()
        self.bar = None
        self._redirect = None
        if stream.isatty():
            # follow the terminal's width; a terminal that reports none (0 columns) gets 100
            sized = os.get_terminal_size(stream.fileno()).columns > 0
            self.bar = tqdm(
                total=total, initial=start, file=stream, unit="step", dynamic_ncols=sized,
                ncols=None if sized else 100,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
            )  # fmt: skip
            # log lines (validation, checkpoints, warnings) print above the bar, not into it
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def update(self, step: int, scalars: dict[str, float | None]) -> None:
        """Show the run at `step` with that log's scalars (loss, tokens_per_s, mfu, ...)."""
        mfu = scalars.get("mfu")
        shown = {
            "loss": f"{scalars['loss']:.4g}",
            "tokens/s": f"{scalars['tokens_per_s']:,.0f}",
            "MFU": "-" if mfu is None else f"{mfu:.1%}",
        }
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        norm = scalars.get("grad_norm")
        shown = {  # a job log line: the optimizer's numbers too
            "loss": shown["loss"], "lr": f"{scalars['lr']:.3g}",
            "grad_norm": "-" if norm is None else f"{norm:.4g}", **shown, "ETA": self.eta(step),
        }  # fmt: skip
        fields = " | ".join(f"{k} {v}" for k, v in shown.items())
        log.info("step %d/%d | %s", step, self.total, fields)

    def eta(self, step: int) -> str:
        """Time left at the run's average pace since this process started (validation and
        checkpoints included, as they recur)."""
        if step <= self.start:
            return "-"
        seconds = (time.perf_counter() - self.started) / (step - self.start) * (self.total - step)
        return tqdm.format_interval(seconds)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self._redirect.__exit__(None, None, None)
