"""torchrun driver for the distributed equivalence tests (not a test file itself).

    torchrun --nproc_per_node=N tests/parallel/driver.py OUT TP PP ZERO[,ZERO..] VARIANT[,VARIANT..]
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANT --save-at K
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANT --resume CHECKPOINT
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANTS --stability VARIANT[,..]

Builds the model in its engine exactly as training does (build_trainee, through
tests.models.trainee_for) and runs a few steps with train_step, on data that depends only on
(step, global sequence index), so every layout sees the same global batch. Records on every
rank: the global-batch loss of each step, the full gradient of every parameter just before
each optimizer step (ZeRO fragments and TP shards gathered, pipeline names mapped to
BeliefLM's), the full parameters at the end, and each step's z-loss when train.z_loss is
set. Writes OUT_DIR/<variant>-zero<stage>-rank<r>.pt. With --stability, the variants named
there also train with model.qk_norm and train.z_loss (STABILITY; with --chunk N a chunked
loss too), written as OUT_DIR/<variant>-stability-zero<stage>-rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

from belief_lm.config import load_config  # noqa: E402
from belief_lm.model.pipeline import canonical_name  # noqa: E402
from belief_lm.parallel.dims import ParallelDims  # noqa: E402
from belief_lm.parallel.env import detect  # noqa: E402
from belief_lm.parallel.gather import full_state_dict, gather_tensor_parallel  # noqa: E402
from belief_lm.parallel.grid import ProcessGrid  # noqa: E402
from belief_lm.preflight import resume_from  # noqa: E402
from belief_lm.runtime import select_device  # noqa: E402
from belief_lm.train import trainer_state  # noqa: E402
from tests.models import trainee_for  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS = 256, 16, 8, 2, 3
STABILITY = ("model.qk_norm=true", "train.z_loss=0.01")
"""The stability options' runs: QK-norm and a z-loss large enough to move the gradients."""


def config(tp: int, pp: int, zero: int, variant: str, *overrides: str):
    """The tests' run at a layout; `overrides` (config key=value) after the fixed ones."""
    return load_config(
        "configs/model/tiny.yaml",
        [
            f"model.attention={variant}", "model.num_layers=4", "model.hidden_size=64",
            "model.ffn_hidden_size=96", f"model.seq_length={SEQ}", f"model.vocab_size={VOCAB}",
            f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.zero_stage={zero}",
            f"train.micro_batch_size={MICRO}", f"train.global_batch_size={GLOBAL_BATCH}",
            "train.lr=3e-3", "train.warmup_steps=0", "train.grad_clip=1.0",
            "run.seed=7", "train.precision=fp32", *overrides,
        ],
    )  # fmt: skip


class GlobalBatches:
    """This data-parallel rank's micro-batches: sequence j of step k is row k*G + j of a
    fixed random table, and DP rank r takes rows r*GA*M .. (r+1)*GA*M - 1 of each step.
    Its state (the next step) does not depend on the layout, so it resumes on any."""

    def __init__(self, accumulation: int, data_rank: int, steps: int = 64):
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randint(0, VOCAB, (steps * GLOBAL_BATCH, SEQ + 1), generator=gen)
        self.accumulation, self.rank, self.step, self.micro = accumulation, data_rank, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        start = self.step * GLOBAL_BATCH + (self.rank * self.accumulation + self.micro) * MICRO
        rows = self.table[start : start + MICRO]
        self.micro += 1
        if self.micro == self.accumulation:
            self.step, self.micro = self.step + 1, 0
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"step": self.step, "micro": self.micro}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.micro = state["step"], state["micro"]


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def run(
    grid: ProcessGrid, out_dir: str, zero: int, variant: str, save_at=None, resume=None,
    steps=STEPS, overrides: tuple[str, ...] = (), name: str | None = None,
) -> None:  # fmt: skip
    """Train and record one run on `grid`; its file is named after `name` (default: the
    variant)."""
    layout = grid.layout
    cfg = config(layout.tensor, layout.pipeline, zero, variant, *overrides)
    cfg.run.output_dir = out_dir
    cfg.checkpoint.resume = resume or "never"
    # the synthetic data below resumes at any data-parallel size: only the weights' checks
    checkpoint = resume_from(cfg, grid.dims)
    trainee = trainee_for(
        cfg, grid, VOCAB, load_universal=checkpoint is not None and checkpoint.other_layout
    )
    engine = trainee.engine
    data = GlobalBatches(engine.gradient_accumulation_steps(), layout.data_rank)
    first = 0
    if checkpoint is not None:
        first = trainer_state.restore(checkpoint, cfg, engine, grid)
        data.load_state_dict(trainer_state.load_data_state(checkpoint))
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
    losses, norms, z_losses = [], [], []
    for _ in range(first, save_at or steps):
        outcome = trainee.train_step(data)
        losses.append(trainee.global_mean(outcome.loss))
        norms.append(float(engine.get_global_grad_norm()))
        if "z_loss" in outcome.reported:
            z_losses.append(trainee.global_mean(outcome.reported["z_loss"]))
    if save_at:
        tokenizer = Path(out_dir) / "tokenizer.model"  # the checkpoint copies it; any bytes do
        tokenizer.write_bytes(b"synthetic data: no tokenizer")
        state = trainer_state.rank_state(layout)
        checkpoints = trainer_state.checkpointer(cfg, engine, grid)
        trainer_state.save(
            cfg, checkpoints, state, layout, save_at, 0, VOCAB, tokenizer, data.state_dict()
        )
    params = full_state_dict(engine.module, rename)
    logits = None
    if not trainee.pipelined:  # logits over the whole vocabulary, for the TP -> TP=1 check
        engine.module.eval()
        with torch.no_grad():
            shard = engine.module(probe_tokens())
        pieces = [torch.empty_like(shard) for _ in range(layout.tensor)]
        dist.all_gather(pieces, shard, group=grid.tensor_group)
        logits = torch.cat(pieces, dim=-1)
    torch.save(
        {
            "losses": losses,
            "grad_norms": norms,
            "z_losses": z_losses,
            "grads": grads_per_step,
            "params": params,
            "logits": logits,
        },
        os.path.join(out_dir, f"{name or variant}-zero{zero}-rank{dist.get_rank()}.pt"),
    )


def join(tp: int, pp: int, timeout_s: float) -> ProcessGrid:
    """This torchrun job's process grid at TP x PP (the rest data-parallel), on the CPU."""
    env = detect()
    dims = ParallelDims(env.world_size, tp, pp)
    return ProcessGrid.join(env, select_device("cpu"), dims, timeout_s=timeout_s)


def main() -> None:
    out_dir, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    zero_stages, variants = map(int, sys.argv[4].split(",")), sys.argv[5].split(",")
    options = dict(zip(sys.argv[6::2], sys.argv[7::2], strict=True))
    grid = join(tp, pp, timeout_s=300)
    save_at = int(options["--save-at"]) if "--save-at" in options else None
    steps = int(options.get("--steps", STEPS))
    stability = [*STABILITY, f"train.loss_chunk_tokens={options.get('--chunk', 0)}"]
    for zero in zero_stages:  # one process grid for all: start-up dominates on CPU
        for variant in variants:
            run(grid, out_dir, zero, variant, save_at, options.get("--resume"), steps)
        for variant in filter(None, options.get("--stability", "").split(",")):
            name = f"{variant}-stability"
            run(grid, out_dir, zero, variant, overrides=tuple(stability), name=name, steps=steps)
    dist.barrier()


if __name__ == "__main__":
    main()
