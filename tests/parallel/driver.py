"""torchrun driver for the distributed equivalence tests (not a test file itself).

    torchrun --nproc_per_node=N tests/parallel/driver.py OUT TP PP ZERO[,ZERO..] VARIANT[,VARIANT..]
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANT --save-at K
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANT --resume CHECKPOINT
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANTS --documents VARIANT[,..]
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANTS --stability VARIANT[,..]
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANTS --gpt2 V[,..] --no-sp V[,..]
    torchrun ... tests/parallel/driver.py OUT_DIR TP PP ZERO VARIANTS --long V[,..]
        [--long-zero ZERO[,ZERO..]]
        --padded VARIANT [--padded-micro MICRO[,MICRO..]]

Builds the model in its engine exactly as training does (build_trainee, through
tests.models.trainee_for) and runs a few steps with train_step, on data that depends only on
(step, global sequence index), so every layout sees the same global batch. Records on every
rank: the global-batch loss of each step, the full gradient of every parameter just before
each optimizer step (ZeRO fragments and TP shards gathered, pipeline names mapped to
BeliefLM's), the full parameters at the end, and each step's z-loss when train.z_loss is
set; the belief diagnostics with the per-layer max_logit and output_rms of the first
weights on a probe batch (each data-parallel rank its own; the logged numbers are data-
parallel rank 0's, the same on every rank), and each step's per-layer gradient norms as
the trainer measures them (layer_signals.layer_grad_norms, through Trainee.before_update:
with a pipeline, from inside the engine's optimizer step), and what a loss-spike check
(train_step's `screen`) saw of each step: the loss and the engine's updates done so far.
Writes
OUT_DIR/<variant>-zero<stage>-rank<r>.pt. With --documents, the variants named there also
train under model.attention_mask=document, on the same table with an EOS (DOCUMENT_END)
closing documents of 1 to 6 tokens, written as
OUT_DIR/<variant>-documents-zero<stage>-rank<r>.pt. With --stability, the variants named
there also train with model.qk_norm and train.z_loss (STABILITY; with --chunk N a chunked
loss too), written as OUT_DIR/<variant>-stability-zero<stage>-rank<r>.pt; a variant named
in both trains its document-masked run with QK-norm and the z-loss as well. With
--padded, that variant also trains on the same table with labels masked (PADDED: a random
number of labels kept per row, every fifth row a padded window without any), at each
micro-batch size of --padded-micro (default MICRO; the accumulation steps follow), under
the first ZeRO stage only, written as OUT_DIR/<variant>-padded-micro<M>-zero<stage>-rank<r>.pt:
the loss weighted by tokens makes every split of such a step the same step.
Likewise --gpt2 (GPT2: the LayerNorm / GELU / learned-positions / biases architecture,
whose norm biases, position embeddings and row-parallel biases sequence parallelism also
touches), --no-sp (parallel.sequence_parallel=false) and --long (the plain run), written as
<variant>-gpt2-..., <variant>-nosp-... and <variant>-long-...; the --no-sp and --long runs
take LONG_STEPS steps, the --long runs under the ZeRO stages of --long-zero only (default:
every stage of the job).
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
from belief_lm.train import layer_signals, trainer_state  # noqa: E402
from belief_lm.train.diagnostics import belief_diagnostics  # noqa: E402
from belief_lm.train.spikes import LossCheck  # noqa: E402
from tests.models import trainee_for  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS = 256, 16, 8, 2, 3
LONG_STEPS = 10
"""The steps of the --long and --no-sp runs: sequence parallelism on and off held to one
process over ten steps, every variant."""
DOCUMENT_END = 2
"""The EOS id of the document-masked runs (a trained tokenizer's)."""
STABILITY = ("model.qk_norm=true", "train.z_loss=0.01")
"""The stability options' runs: QK-norm and a z-loss large enough to move the gradients."""
VARIATIONS = {
    "gpt2": (
        "model.normalization=LayerNorm", "model.activation=gelu", "model.bias=true",
        "model.position_embedding=learned_absolute",
    ),
    "nosp": ("parallel.sequence_parallel=false",),
    "long": (),
}  # fmt: skip
"""The other named runs (--gpt2, --no-sp, --long): their config overrides."""

IGNORE = -100
"""A label not trained on (belief_lm.model.loss.IGNORE_INDEX)."""


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

    def __init__(
        self, accumulation: int, data_rank: int, steps: int = 64, documents: bool = False,
        padded: bool = False, micro: int = MICRO,
    ):  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randint(0, VOCAB, (steps * GLOBAL_BATCH, SEQ + 1), generator=gen)
        if documents:  # about one token in four an EOS: several documents in every window
            ends = torch.rand(self.table.shape, generator=gen) < 0.25
            self.table = self.table.masked_fill(ends, DOCUMENT_END)
        self.labels = self.table[:, 1:]
        if padded:  # each row keeps 0 to SEQ labels (every fifth none: a padded window)
            kept = torch.randint(0, SEQ + 1, (len(self.table), 1), generator=gen)
            kept[4::5] = 0
            self.labels = self.labels.masked_fill(torch.arange(SEQ) >= kept, IGNORE)
        self.accumulation, self.rank, self.micro_size = accumulation, data_rank, micro
        self.step, self.micro = 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        size = self.micro_size
        start = self.step * GLOBAL_BATCH + (self.rank * self.accumulation + self.micro) * size
        rows = slice(start, start + size)
        self.micro += 1
        if self.micro == self.accumulation:
            self.step, self.micro = self.step + 1, 0
        return self.table[rows, :-1].contiguous(), self.labels[rows].contiguous()

    def state_dict(self) -> dict:
        return {"step": self.step, "micro": self.micro}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.micro = state["step"], state["micro"]


def probe_tokens(data_rank: int = 0) -> torch.Tensor:
    """A batch of MICRO sequences outside the training table, a different one for each
    data-parallel rank (the one-process reference sees data-parallel rank 0's)."""
    generator = torch.Generator().manual_seed(1 + data_rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=generator)


def run(
    grid: ProcessGrid, out_dir: str, zero: int, variant: str, save_at=None, resume=None,
    steps=STEPS, overrides: tuple[str, ...] = (), name: str | None = None, padded=False,
) -> None:  # fmt: skip
    """Train and record one run on `grid`; its file is named after `name` (default: the
    variant); `padded`: on labels masked (GlobalBatches)."""
    layout = grid.layout
    cfg = config(layout.tensor, layout.pipeline, zero, variant, *overrides)
    cfg.run.output_dir = out_dir
    cfg.checkpoint.resume = resume or "never"
    # the synthetic data below resumes at any data-parallel size: only the weights' checks
    checkpoint = resume_from(cfg, grid.dims)
    universal = checkpoint is not None and checkpoint.other_layout
    trainee = trainee_for(cfg, grid, VOCAB, load_universal=universal, eos_id=DOCUMENT_END)
    engine = trainee.engine
    documents = cfg.model.attention_mask == "document"
    data = GlobalBatches(
        engine.gradient_accumulation_steps(), layout.data_rank, documents=documents,
        padded=padded, micro=cfg.train.micro_batch_size,
    )  # fmt: skip
    first = 0
    if checkpoint is not None:
        first = trainer_state.restore(checkpoint, cfg, engine, grid)
        data.load_state_dict(trainer_state.load_data_state(checkpoint))
    rename = (lambda n: canonical_name(n, cfg.model.num_layers)) if trainee.pipelined else None
    # the belief diagnostics and per-layer signals of the first weights (a later step's
    # carry AdamW's rounding noise) on a probe batch of this data-parallel rank's: what is
    # logged must be data-parallel rank 0's, as one process's on that batch
    probe = probe_tokens(layout.data_rank)
    diagnostics = belief_diagnostics(engine, probe, probe, trainee.pipelined)

    grads_per_step, layer_grad_norms = [], []
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
    # the trainer's measurement, where the trainer makes it (a pipeline's: inside train_batch)
    trainee.before_update = lambda: layer_grad_norms.append(
        layer_signals.layer_grad_norms(engine.module)
    )
    screened = []  # (the engine's updates so far, the loss): what a spike check sees

    def screen(loss: torch.Tensor) -> LossCheck:
        mean = trainee.global_mean(loss)
        screened.append((engine.global_steps, mean))
        return LossCheck(mean, spike=None, skip=False)

    losses, norms, z_losses = [], [], []
    for _ in range(first, save_at or steps):
        outcome = trainee.train_step(data, screen)
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
            "diagnostics": diagnostics,
            "layer_grad_norms": layer_grad_norms,
            "screened": screened,
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
    zero_stages, variants = [int(z) for z in sys.argv[4].split(",")], sys.argv[5].split(",")
    options = dict(zip(sys.argv[6::2], sys.argv[7::2], strict=True))
    grid = join(tp, pp, timeout_s=300)
    save_at = int(options["--save-at"]) if "--save-at" in options else None
    steps = int(options.get("--steps", STEPS))
    documents = options.get("--documents", "").split(",")
    stabilized = options.get("--stability", "").split(",")
    padded = options.get("--padded-micro", str(MICRO)) if "--padded" in options else ""
    padded_micro = [int(m) for m in filter(None, padded.split(","))]
    stability = [*STABILITY, f"train.loss_chunk_tokens={options.get('--chunk', 0)}"]
    long_zero = [int(z) for z in options.get("--long-zero", sys.argv[4]).split(",")]
    for zero in zero_stages:  # one process grid for all: start-up dominates on CPU
        for variant in variants:
            run(grid, out_dir, zero, variant, save_at, options.get("--resume"), steps)
        for variant in filter(None, documents):
            together = STABILITY if variant in stabilized else ()  # the mask with both
            overrides = ("model.attention_mask=document", *together)
            name = f"{variant}-documents"
            run(grid, out_dir, zero, variant, overrides=overrides, name=name, steps=steps)
        for variant in filter(None, stabilized):
            name = f"{variant}-stability"
            run(grid, out_dir, zero, variant, overrides=tuple(stability), name=name, steps=steps)
        for kind, overrides in VARIATIONS.items():
            option = "--no-sp" if kind == "nosp" else f"--{kind}"
            if kind == "long" and zero not in long_zero:
                continue
            for variant in filter(None, options.get(option, "").split(",")):
                name = f"{variant}-{kind}"
                length = LONG_STEPS if kind in ("nosp", "long") else steps
                run(grid, out_dir, zero, variant, overrides=overrides, name=name, steps=length)
        for micro in padded_micro if zero == zero_stages[0] else []:
            overrides = (f"train.micro_batch_size={micro}",)
            name = f"{options['--padded']}-padded-micro{micro}"
            run(grid, out_dir, zero, options["--padded"], overrides=overrides, name=name,
                steps=steps, padded=True)  # fmt: skip
    dist.barrier()


if __name__ == "__main__":
    main()
