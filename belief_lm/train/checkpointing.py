"""Checkpoints from the trainer's side: what to resume from, restoring, saving.

Everything a continuation needs is saved: DeepSpeed's engine (weights, optimizer, LR
schedule), every rank's data-stream position and RNG states, the step and tokens
consumed, the effective config and the tokenizer. On the same layout the continuation is
bit-exact. On another layout the checkpoint goes through DeepSpeed's universal format
(belief_lm/checkpoint/universal.py); the data stream then continues by data-parallel
rank, so the data-parallel size must not change (streams are sharded per DP rank).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from belief_lm.checkpoint import store
from belief_lm.checkpoint.store import CheckpointError, CheckpointInfo
from belief_lm.checkpoint.universal import convert, universal_info
from belief_lm.config import Config
from belief_lm.parallel.setup import Layout

log = logging.getLogger("belief_lm.checkpoint")

CONVERSION_TIMEOUT = timedelta(hours=2)
"""How long other ranks wait while rank 0 converts a checkpoint to the universal form."""


RUNTIME_ONLY = {"name", "fused_projections"}
"""Model-config keys that do not change the architecture (free to differ on resume)."""


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint to continue from, and whether it needs the universal path."""

    path: Path
    info: CheckpointInfo
    other_layout: bool


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.run.output_dir).expanduser() / "checkpoints"


def plan_resume(cfg: Config, layout: Layout) -> ResumePlan | None:
    """Decide before the engine exists (loading on another layout changes its config).
    Raises CheckpointError for a named checkpoint that is unusable or incompatible."""
    choice = cfg.checkpoint.resume
    if choice == "never":
        return None
    if choice == "auto":
        path = store.newest_checkpoint(checkpoint_root(cfg))
        if path is None:
            return None
    else:
        path = Path(choice).expanduser()
    info = store.read_info(path)
    _check_compatible(cfg, path)
    saved = (info.tensor, info.pipeline, info.data, info.zero_stage)
    other_layout = saved != (layout.tensor, layout.pipeline, layout.data, cfg.parallel.zero_stage)
    if other_layout:
        if info.data != layout.data:
            raise CheckpointError(
                f"checkpoint {path} was saved with data-parallel size {info.data}; this job "
                f"has {layout.data}. The data stream is sharded per data-parallel rank, so "
                f"it cannot continue without losing or repeating documents: choose a layout "
                f"with data-parallel size {info.data}"
            )
        if cfg.parallel.zero_stage not in (1, 2) or info.zero_stage not in (1, 2):
            raise CheckpointError(
                f"resuming checkpoint {path} (ZeRO {info.zero_stage}, TP{info.tensor} x "
                f"PP{info.pipeline}) on another layout goes through DeepSpeed's universal "
                f"checkpoints, which need ZeRO stage 1 or 2 on both sides "
                f"(parallel.zero_stage={cfg.parallel.zero_stage})"
            )
    return ResumePlan(path, info, other_layout)


def _check_compatible(cfg: Config, path: Path) -> None:
    """The model and data sections must be the ones the checkpoint was trained with."""
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable config.yaml ({err})") from None
    current = cfg.model_dump(mode="json")
    for section in ("model", "data"):
        old = saved.get(section, {})
        differ = sorted(
            f"{section}.{k} (checkpoint: {old.get(k)!r}, now: {v!r})"
            for k, v in current[section].items()
            if old.get(k) != v and k not in RUNTIME_ONLY
        )
        if differ:
            raise CheckpointError(
                f"checkpoint {path} was trained with a different {section} config: "
                + "; ".join(differ)
            )


def restore(plan: ResumePlan, cfg: Config, engine, data, layout: Layout) -> int:
    """Load `plan` into the engine and this rank's data stream; returns the saved step."""
    if plan.other_layout:
        source = plan.path.with_name(f"{plan.path.name}-universal")
        if dist.get_rank() == 0 and not (source / "run.json").exists():
            log.info("converting %s to the universal format for the new layout", plan.path)
            convert(plan.path, source, cfg.model)
        dist.barrier(group=dist.new_group(backend="gloo", timeout=CONVERSION_TIMEOUT))
    else:
        source = plan.path
    loaded, _ = engine.load_checkpoint(
        str(source.parent), tag=source.name, load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )  # fmt: skip
    if loaded is None:
        raise CheckpointError(f"DeepSpeed found no loadable checkpoint in {source}")
    state = _rank_state(plan, layout)
    data.load_state_dict(state["data"])
    if plan.other_layout:  # RNG streams belong to ranks of the old layout: derive new ones
        torch.manual_seed(cfg.run.seed * 1_000_003 + plan.info.step * 1009 + dist.get_rank())
    else:
        store.set_rng_state(state["rng"])
    log.info("resumed from %s at step %d", plan.path, plan.info.step)
    return plan.info.step


def _rank_state(plan: ResumePlan, layout: Layout) -> dict:
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


def save(cfg: Config, engine, data, layout: Layout, step: int, consumed_tokens: int,
         vocab_size: int, tokenizer_path: Path) -> Path:  # fmt: skip
    """Save a checkpoint at `step` (collective)."""
    info = CheckpointInfo(
        step=step, consumed_tokens=consumed_tokens, tensor=layout.tensor,
        pipeline=layout.pipeline, data=layout.data, zero_stage=cfg.parallel.zero_stage,
        vocab_size=vocab_size,
    )  # fmt: skip
    rank_state = {
        "dp_rank": layout.data_rank,
        "data": data.state_dict(),
        "rng": store.rng_state(),
    }
    extra = {"config.yaml": cfg.to_yaml().encode(), "tokenizer.model": tokenizer_path.read_bytes()}
    client = {"universal_checkpoint_info": universal_info(cfg.model), "step": step}
    path = store.save(
        engine, checkpoint_root(cfg), info, rank_state, extra, client, cfg.checkpoint.keep
    )
    log.info("saved checkpoint %s", path)
    return path
