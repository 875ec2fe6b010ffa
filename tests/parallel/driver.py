"""torchrun driver for the distributed equivalence tests (not a test file itself).

    torchrun --nproc_per_node=N tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANT[,VARIANT...]

Builds the engine exactly as training does (belief_lm.train.engine.build_engine) and runs
a few steps with train_step, on data that depends only on (step, global sequence index),
so every layout sees the same global batch. Records on every rank: the global-batch loss
of each step, the full gradient of every parameter just before each optimizer step
(ZeRO fragments and TP shards gathered, pipeline names mapped to BeliefLM's), and the full
parameters at the end. Writes OUT_DIR/<variant>-rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402

from belief_lm.config import load_config  # noqa: E402
from belief_lm.parallel.gather import full_state_dict, gather_tensor_parallel  # noqa: E402
from belief_lm.parallel.pipeline import canonical_name  # noqa: E402
from belief_lm.parallel.setup import init_distributed, init_model_parallel  # noqa: E402
from belief_lm.runtime import select_device  # noqa: E402
from belief_lm.train.engine import build_engine  # noqa: E402
from belief_lm.train.loop import _mean_over_data_parallel, train_step  # noqa: E402
from launcher.env import detect  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS = 256, 16, 8, 2, 3


def config(tp: int, pp: int, zero: int, variant: str):
    return load_config(
        "configs/model/tiny.yaml",
        [
            f"model.attention={variant}", "model.num_layers=4", "model.hidden_size=64",
            "model.ffn_hidden_size=96", f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}",
            f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.zero_stage={zero}",
            f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL_BATCH}",
            "train.lr=3e-3", "train.warmup_steps=0", "train.grad_clip=1.0",
            "run.seed=7", "train.precision=fp32",
        ],
    )  # fmt: skip


def micro_batches(steps: int, accumulation: int):
    """This data-parallel rank's micro-batches: sequence j of step k is row k*G + j of a
    fixed random table, and DP rank r takes rows r*GA*M .. (r+1)*GA*M - 1 of each step."""
    table = torch.randint(
        0, VOCAB, (steps * GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    rank = ps.get_data_parallel_rank()
    for step in range(steps):
        for m in range(accumulation):
            start = step * GLOBAL_BATCH + (rank * accumulation + m) * MICRO
            rows = table[start : start + MICRO]
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def run(out_dir: str, tp: int, pp: int, zero: int, variant: str) -> None:
    cfg = config(tp, pp, zero, variant)
    layout = init_model_parallel(tp, pp)
    trainee = build_engine(cfg, layout, VOCAB, torch.device("cpu"))
    engine = trainee.engine
    rename = (lambda n: canonical_name(n, cfg.model.num_layers)) if trainee.pipelined else None

    grads_per_step = []
    take_step = engine._take_model_step

    def capture_then_step(*args, **kwargs):
        grads = {}
        for name, param in engine.module.named_parameters():
            full = gather_tensor_parallel(safe_get_full_grad(param).detach().clone(), param)
            key = rename(name) if rename else name
            if key is not None:
                grads[key] = full
        grads_per_step.append(grads)
        return take_step(*args, **kwargs)

    engine._take_model_step = capture_then_step
    data = micro_batches(STEPS, engine.gradient_accumulation_steps())
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(_mean_over_data_parallel(train_step(trainee, data), trainee))
        norms.append(float(engine.get_global_grad_norm()))
    params = full_state_dict(engine.module, rename)
    logits = None
    if not trainee.pipelined:  # logits over the whole vocabulary, for the TP -> TP=1 check
        engine.module.eval()
        with torch.no_grad():
            shard = engine.module(probe_tokens())
        pieces = [torch.empty_like(shard) for _ in range(tp)]
        dist.all_gather(pieces, shard, group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(pieces, dim=-1)
    torch.save(
        {
            "losses": losses,
            "grad_norms": norms,
            "grads": grads_per_step,
            "params": params,
            "logits": logits,
        },
        os.path.join(out_dir, f"{variant}-zero{zero}-rank{dist.get_rank()}.pt"),
    )


def main() -> None:
    out_dir, tp, pp, zero, variants = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    device = select_device("cpu")
    init_distributed(detect(), device, timeout_s=120)
    for variant in variants.split(","):
        run(out_dir, tp, pp, zero, variant)
    dist.barrier()


if __name__ == "__main__":
    main()
