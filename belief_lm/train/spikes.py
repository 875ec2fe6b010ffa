"""Loss spikes: each step's loss against a running robust estimate of the loss.

The estimate is the median of the last train.spike.window losses and their median absolute
deviation (MAD) scaled by 1.4826, which is the standard deviation for normal noise; a few
outliers move neither, as they would a mean and a standard deviation. A loss more than
train.spike.threshold such deviations above the median is a spike. The loss judged is the
step's global mean, the same number on every rank, so every rank reaches the same verdict
(and with train.spike.action=skip the veto is all-reduced with the non-finite flag anyway,
in GuardedAdamW, so no rank can update alone). `LossCheck` is the verdict as the step
takes it and hands it back.

Every finite loss joins the history, spikes included: a lasting change of level (new data)
moves the median within about half a window instead of being skipped forever.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from belief_lm.config import SpikeConfig

MAD_TO_STD = 1.4826
"""MAD x this = the standard deviation, for normally distributed noise."""
RELATIVE_FLOOR = 1e-3
"""The deviation is at least this fraction of the median: on a flat stretch (MAD near 0)
a change in the fourth digit is not a spike."""


@dataclass(frozen=True)
class Spike:
    """A step whose loss was judged a spike, and what it was judged against."""

    step: int
    loss: float
    median: float
    deviation: float
    """1.4826 x MAD of the history (at least RELATIVE_FLOOR x median)."""
    history: int
    """Steps of loss history it was judged against."""

    @property
    def score(self) -> float:
        """Deviations above the median."""
        return (self.loss - self.median) / self.deviation

    def scalars(self, skipped: bool) -> dict[str, float]:
        """Its metrics row (prefix `spike`)."""
        return {
            "spike_loss": self.loss,
            "spike_median": self.median,
            "spike_deviation": self.deviation,
            "spike_score": self.score,
            "spike_skipped": float(skipped),
        }


@dataclass(frozen=True)
class LossCheck:
    """A step's loss judged before its update: what the engine's step is told, and returns."""

    mean: float
    """The step's loss averaged over the global batch (the same on every rank)."""
    spike: Spike | None
    """The spike it was, if it was one."""
    skip: bool
    """Whether to skip the update (a spike with train.spike.action=skip)."""
    layers: tuple[dict, list] | None = None
    """A spike's per-layer gradient norms and the layers whose norm grew most, taken before
    its update (belief_lm.train.layer_signals.GradientWatch.spike_report)."""


class SpikeDetector:
    """The loss history of a run and the verdict on each new step's loss."""

    def __init__(self, cfg: SpikeConfig, state: dict | None = None):
        assert cfg.threshold is not None, "spike detection is off (train.spike.threshold)"
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.in_a_row = 0
        """Consecutive spikes up to the last judged step."""
        if state is not None:
            self.history.extend(state["history"])
            self.in_a_row = state["in_a_row"]

    def check(self, step: int, loss: float) -> Spike | None:
        """Judge `loss`, step `step`'s, against the history, then add it. A non-finite loss
        is neither judged nor kept (the optimizer skips that step on its own)."""
        if not math.isfinite(loss):
            self.in_a_row = 0
            return None
        spike = None
        if len(self.history) >= self.cfg.min_history:
            median, deviation = robust_estimate(self.history)
            if loss > median + self.cfg.threshold * deviation:
                spike = Spike(step, loss, median, deviation, len(self.history))
        self.history.append(loss)
        self.in_a_row = self.in_a_row + 1 if spike else 0
        return spike

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so a resumed run judges its first steps too."""
        return {"history": list(self.history), "in_a_row": self.in_a_row}


def robust_estimate(losses: Iterable[float]) -> tuple[float, float]:
    """The median of `losses` and their deviation (1.4826 x MAD, floored)."""
    values = list(losses)
    median = statistics.median(values)
    mad = statistics.median(abs(x - median) for x in values)
    return median, max(MAD_TO_STD * mad, RELATIVE_FLOOR * abs(median), 1e-12)
