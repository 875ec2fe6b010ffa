"""torchrun driver of the two-rank observability test (not a test file itself).

    torchrun --nproc_per_node=2 tests/train/observe_ranks.py SLOW_S SPIKE_STEP train ...

Runs the real command line (belief_lm.cli.main, console set-up included) with three
things done to it: rank 1 is slow (SLOW_S seconds of sleep in each model forward pass),
step SPIKE_STEP's loss spikes on rank 0 alone (the global loss spikes, and rank 1, whose
own loss is normal, must skip that update too), and rank 0 issues one real warning, which
must still reach the console.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

REAL_WARNING = "observe_ranks: a real warning, to be shown"


def main() -> int:
    slow, spike_step, *argv = sys.argv[1:]
    rank = int(os.environ["RANK"])
    from belief_lm import logs

    logs.configure(rank)  # what the command does first, before the libraries are imported
    import belief_lm.model.gpt as gpt
    from belief_lm import cli
    from belief_lm.train.loop import Trainer

    scale = {"loss": 1.0}
    real_loss, real_forward, real_step = gpt.lm_loss, gpt.BeliefLM.forward, Trainer.train_step

    def lm_loss(logits, labels, z_loss=0.0):
        terms = real_loss(logits, labels, z_loss)
        return terms._replace(loss=terms.loss * scale["loss"])

    def forward(self, *args, **kwargs):
        if rank == 1:
            time.sleep(float(slow))
        return real_forward(self, *args, **kwargs)

    def train_step(trainer):
        step = trainer.step + 1
        if rank == 0 and step == 1:
            warnings.warn(REAL_WARNING, UserWarning, stacklevel=1)
        scale["loss"] = 30.0 if rank == 0 and step == int(spike_step) else 1.0
        try:
            return real_step(trainer)
        finally:
            scale["loss"] = 1.0

    gpt.lm_loss, gpt.BeliefLM.forward, Trainer.train_step = lm_loss, forward, train_step
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
