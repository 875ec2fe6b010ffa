"""torchrun driver: the real training loop with a NaN injected on one rank.

    torchrun --nproc_per_node=N tests/parallel/faults.py OUT_DIR NAN_STEPS NAN_RANK [overrides]

NAN_STEPS (e.g. "3" or "3,4") are 1-based optimizer steps at which global rank NAN_RANK
multiplies its first decoder layer's output by NaN. Saves, per rank, the TrainResult and
a checksum of this rank's weights before and after every step to OUT_DIR/rank<r>.pt; an
exception is recorded and re-raised (the process must exit non-zero).
"""

import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import belief_lm.train.loop as loop  # noqa: E402
from belief_lm.config import load_config  # noqa: E402
from belief_lm.model.gpt import DecoderLayer  # noqa: E402
from belief_lm.train.engine import Trainee  # noqa: E402


def main():
    out_dir, nan_steps, nan_rank, *overrides = sys.argv[1:]
    nan_steps, nan_rank = {int(s) for s in nan_steps.split(",")}, int(nan_rank)
    record = {"checksums": [], "error": None, "result": None}
    original_step, calls = Trainee.train_step, []

    def checksum(trainee):
        return sum(
            float(p.detach().double().abs().sum()) for p in trainee.engine.module.parameters()
        )

    def faulty_step(trainee, micro_batches, screen=None):
        calls.append(None)
        hook = None
        if len(calls) in nan_steps and dist.get_rank() == nan_rank:
            layer = next(m for m in trainee.engine.module.modules() if isinstance(m, DecoderLayer))
            hook = layer.register_forward_hook(lambda m, args, out: out * float("nan"))
        before = checksum(trainee)
        try:
            outcome = original_step(trainee, micro_batches, screen)
        finally:
            if hook is not None:
                hook.remove()
        record["checksums"].append((before, checksum(trainee)))
        return outcome

    Trainee.train_step = faulty_step
    cfg = load_config("configs/test/micro.yaml", overrides)
    try:
        record["result"] = loop.train(cfg)
    except loop.NonFiniteLossError as err:
        record["error"] = str(err)
        raise
    finally:
        torch.save(record, f"{out_dir}/rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
