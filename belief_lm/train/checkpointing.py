"""Checkpoints from the trainer's side: restoring a resume plan, saving a step.

Everything a continuation needs is saved: DeepSpeed's engine (weights, optimizer, LR
schedule), every rank's data-stream position and RNG states (`rank_state`), the step and
tokens consumed, the effective config and the tokenizer. On the same layout the
continuation is bit-exact. On another layout the checkpoint goes through DeepSpeed's
universal format (belief_lm/checkpoint/universal.py); which checkpoint to resume from, and
whether it can continue on this layout, is decided before any work by
`belief_lm.preflight.plan_resume`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from belief_lm.checkpoint import store
from belief_lm.checkpoint.files import CheckpointError, CheckpointInfo
from belief_lm.checkpoint.universal import ensure_universal, universal_info
from belief_lm.config import Config
from belief_lm.parallel.dims import Layout
from belief_lm.preflight import ResumePlan, checkpoint_root
from belief_lm.runtime import derived_seed

log = logging.getLogger("belief_lm.checkpoint")

RESEED_STRIDE = 1009
"""Spreads the RNG seeds derived after a layout change over steps (see `restore`)."""


def rank_state(data, layout: Layout) -> dict:
    """This rank's part of a checkpoint beyond the engine: its data stream's position and
    its RNG states."""
    return {"dp_rank": layout.data_rank, "data": data.state_dict(), "rng": store.rng_state()}


def restore(plan: ResumePlan, cfg: Config, engine, data, layout: Layout) -> int:
    """Load `plan` into the engine and this rank's data stream; returns the saved step."""
    source = ensure_universal(plan.path, cfg.model) if plan.other_layout else plan.path
    loaded, _ = engine.load_checkpoint(
        str(source.parent), tag=source.name, load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )  # fmt: skip
    if loaded is None:
        raise CheckpointError(f"DeepSpeed found no loadable checkpoint in {source}")
    state = _saved_rank_state(plan, layout)
    data.load_state_dict(state["data"])
    if plan.other_layout:  # RNG streams belong to ranks of the old layout: derive new ones
        torch.manual_seed(
            derived_seed(cfg.run.seed, plan.info.step * RESEED_STRIDE + dist.get_rank())
        )
    else:
        store.set_rng_state(state["rng"])
    log.info("resumed from %s at step %d", plan.path, plan.info.step)
    return plan.info.step


def _saved_rank_state(plan: ResumePlan, layout: Layout) -> dict:
    """This rank's saved state: its own file on the same layout, else any saved rank's
    with the same data-parallel rank (its stream position is what matters)."""
    folder = plan.path / "run_state"
    if not plan.other_layout:
        path = folder / f"rank{dist.get_rank():05d}.pt"
        if not path.is_file():
            raise CheckpointError(f"checkpoint {plan.path} has no state for rank {dist.get_rank()}")
        return torch.load(path, weights_only=False)
    for path in sorted(folder.glob("rank*.pt")):
        state = torch.load(path, weights_only=False)
        if state["dp_rank"] == layout.data_rank:
            return state
    raise CheckpointError(
        f"checkpoint {plan.path} has no state for data-parallel rank {layout.data_rank}"
    )


def save(cfg: Config, engine, state: dict, layout: Layout, step: int, consumed_tokens: int,
         vocab_size: int, tokenizer_path: Path) -> Path:  # fmt: skip
    """Save a checkpoint at `step` (collective); `state` is this rank's `rank_state`."""
    info = CheckpointInfo(
        step=step, consumed_tokens=consumed_tokens, tensor=layout.tensor,
        pipeline=layout.pipeline, data=layout.data, zero_stage=cfg.parallel.zero_stage,
        vocab_size=vocab_size,
    )  # fmt: skip
    extra = {"config.yaml": cfg.to_yaml().encode(), "tokenizer.model": tokenizer_path.read_bytes()}
    client = {"universal_checkpoint_info": universal_info(cfg.model), "step": step}
    path = store.save(engine, checkpoint_root(cfg), info, state, extra, client, cfg.checkpoint.keep)
    log.info("saved checkpoint %s", path)
    return path
