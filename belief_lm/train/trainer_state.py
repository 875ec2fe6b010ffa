"""The trainer's state in a checkpoint: what a step's save holds, and restoring it.

(`belief_lm/checkpoint/` is how checkpoints are written, verified and converted; this is
what the trainer puts in and takes out.) Everything a continuation needs is saved:
DeepSpeed's engine (weights, optimizer, LR schedule), every rank's RNG states
(`rank_state`), the data stream's position (the same on every rank: data_state.pt, valid
at any layout), the step and tokens consumed, the effective config and the tokenizer. On the
same layout the continuation is bit-exact. On another layout the checkpoint goes through
DeepSpeed's universal format (belief_lm/checkpoint/universal.py); which checkpoint to
resume from, and whether it can continue on this layout, is decided before any work by
`belief_lm.preflight.resume_from`. A weights-only checkpoint (an import) gives only the
model's weights: the run starts at its step with a fresh optimizer and data stream.

A checkpoint is trusted only once verified against its manifest: pre-flight checks that
every file is there with its size (instant), and `verified_resume` has the ranks read every
file through once between them (each rank a share) before anything is loaded. A damaged
checkpoint named by checkpoint.resume is refused naming the file; with resume=auto the
newest intact one is taken instead, with a warning. Every file is read weights-only
(belief_lm/checkpoint/loading.py): the same pass finds a file holding more than a
checkpoint may, and the run is refused naming it (checkpoint.trust=true: a warning).
What the trainer writes is plain values and tensors: the data pipeline's NumPy arrays are
saved as tensors (`data_state`, `load_data_state`), the RNG states as store.rng_state says.
"""

from __future__ import annotations

import functools
import io
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from belief_lm import compat
from belief_lm.checkpoint import loading, manifest, store
from belief_lm.checkpoint.files import CheckpointError, CheckpointInfo, damaged, step_dirs
from belief_lm.checkpoint.universal import ensure_universal, universal_info
from belief_lm.config import Config
from belief_lm.parallel.dims import Layout, ParallelDims
from belief_lm.parallel.grid import ProcessGrid
from belief_lm.preflight import ResumeFrom, checkpoint_root, resume_from
from belief_lm.runtime import derived_seed

log = logging.getLogger("belief_lm.checkpoint")

RESEED_STRIDE = 1009
"""Spreads the RNG seeds derived after a layout change over steps (see `restore`)."""


DATA_STATE = "data_state.pt"
"""Every logical reader's position, one file per checkpoint (written by rank 0)."""


def rank_state(layout: Layout) -> dict:
    """This rank's part of a checkpoint beyond the engine and the data: its RNG states."""
    return {"dp_rank": layout.data_rank, "rng": store.rng_state()}


def data_state(data) -> dict:
    """The whole run's data position (every rank holds all of it, the same), its NumPy
    arrays as tensors (`load_data_state` turns them back)."""
    return arrays_as_tensors(data.state_dict())


def verified_resume(
    resume: ResumeFrom | None, cfg: Config, dims: ParallelDims
) -> ResumeFrom | None:
    """`resume` once its checkpoint's files are verified (collective: each rank checksums a
    share of them). A damaged checkpoint named by checkpoint.resume raises CheckpointError
    naming the file; with resume=auto the next intact one is taken instead, with a warning
    (`resume_from` refuses a run whose checkpoints are all damaged)."""
    if resume is not None and resume.trusted:
        log.warning(
            "checkpoint.trust is on: a file of the checkpoint holding more than a checkpoint "
            "may is loaded with pickle, which can run any code it holds"
        )
    while resume is not None:
        started = time.perf_counter()
        found, refused = verify_together(resume.path)
        if not found:
            loading.refuse(resume.path, refused, resume.trusted)
            seconds = time.perf_counter() - started
            log.info("verified checkpoint %s in %.1f s", resume.path, seconds)
            return resume
        error = damaged(resume.path, found)
        if cfg.checkpoint.resume != "auto" or resume.branch:  # a branch: no other parent
            raise error
        log.warning("%s; skipping it for an older checkpoint", error)
        # this one and the newer ones (pre-flight found and reported those) are passed over
        newer = [path for step, path in step_dirs(resume.path.parent) if step >= resume.info.step]
        resume = resume_from(cfg, dims, skip=newer)
    return None


def verify_together(path: Path, workers: int = manifest.WORKERS) -> tuple[list[str], list[str]]:
    """Problems of checkpoint `path` (every file read through once) and its files that hold
    more than a checkpoint may (loading.refusals), the same lists on every rank: each rank
    checks its share of the files (manifest.shares), and the findings are gathered. A
    missing or corrupt manifest is found by every rank alike."""
    try:
        records = manifest.read_manifest(path)
    except manifest.ManifestError as err:
        return [str(err)], []
    world, rank = dist.get_world_size(), dist.get_rank()
    share = manifest.shares(records, world)[rank]
    damage = manifest.check(path, records, share, workers=workers)
    mine = (damage, [] if damage else loading.refusals(path, share))
    every_rank = [mine]
    if world > 1:
        every_rank = [None] * world
        dist.all_gather_object(every_rank, mine)
    return tuple(sorted(line for found in every_rank for line in found[i]) for i in (0, 1))


def weights_only(resume: ResumeFrom | None) -> dict[str, torch.Tensor] | None:
    """The whole weights of a weights-only checkpoint to start from (loaded into the model
    before its engine is built, so any layout takes them), or None for any other resume."""
    if resume is None or not resume.info.weights_only:
        return None
    from belief_lm.checkpoint.consolidate import consolidate

    log.info("starting from the weights of %s (fresh optimizer and data stream)", resume.path)
    # verified_resume checked the files
    return consolidate(resume.path, verify=False, trust=resume.trusted).state_dict


def restore(resume: ResumeFrom, cfg: Config, engine, grid: ProcessGrid) -> int:
    """Load checkpoint `resume` into DeepSpeed's `engine` and this rank's RNG states;
    returns the saved step. The data stream's position is `load_data_state`'s."""
    path, layout = resume.path, grid.layout
    source = path
    if resume.other_layout:
        source = ensure_universal(path, cfg.model, grid, resume.trusted)
    # the engine reads through our checkpoint engine (writer.py), its ZeRO optimizers a
    # universal checkpoint directly: both weights-only
    with compat.deepspeed_loads_through(functools.partial(loading.load, trust=resume.trusted)):
        loaded, _ = engine.load_checkpoint(
            str(source.parent), tag=source.name, load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )  # fmt: skip
    if loaded is None:
        raise CheckpointError(f"DeepSpeed found no loadable checkpoint in {source}")
    info = resume.info
    if (info.tensor, info.pipeline, info.data) == (layout.tensor, layout.pipeline, layout.data):
        store.set_rng_state(load_rank_state(resume, grid.rank)["rng"])
    else:  # RNG streams belong to ranks of the old layout: derive new ones
        torch.manual_seed(derived_seed(cfg.run.seed, info.step * RESEED_STRIDE + grid.rank))
    log.info("resumed from %s at step %d", path, info.step)
    return info.step


def load_rank_state(resume: ResumeFrom, rank: int) -> dict:
    """The `rank_state` (and what the trainer added to it) that rank `rank` saved with
    checkpoint `resume`. Rank 0's suits any layout for what every rank holds alike (the
    loss history of spike detection)."""
    path = resume.path / "run_state" / f"rank{rank:05d}.pt"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {resume.path} has no state for rank {rank}")
    return loading.load(path, trust=resume.trusted)


def load_data_state(resume: ResumeFrom) -> dict:
    """The data stream's position saved with checkpoint `resume` (any layout's)."""
    path = resume.path / DATA_STATE
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {resume.path} has no {DATA_STATE}: it was written by an earlier "
            "belief-lm whose data streams were per rank; its data position cannot be continued"
        )
    return tensors_as_arrays(loading.load(path, trust=resume.trusted))


def arrays_as_tensors(state):
    """`state` (nested dicts, lists, tuples) with every NumPy array a tensor and every NumPy
    scalar a Python number: what a checkpoint may hold (loading.py)."""

    def as_tensor(value):
        if isinstance(value, np.ndarray):
            return torch.from_numpy(value.copy())
        return value.item() if isinstance(value, np.generic) else value

    return _map_leaves(state, as_tensor)


def tensors_as_arrays(state):
    """`arrays_as_tensors` undone: every tensor a NumPy array (the data pipeline's state
    holds NumPy arrays and no tensors)."""
    return _map_leaves(state, lambda v: v.numpy() if isinstance(v, torch.Tensor) else v)


def _map_leaves(value, leaf):
    """`value` (nested dicts, lists, tuples, named or not) with `leaf` applied to the rest."""
    if isinstance(value, dict):
        return {key: _map_leaves(item, leaf) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_map_leaves(item, leaf) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return leaf(value)


def checkpointer(cfg: Config, engine, grid: ProcessGrid) -> store.Checkpointer:
    """What saves the checkpoints of DeepSpeed's `engine` (collective: every rank makes
    one; the ranks agree in the grid's checkpoint group)."""
    return store.Checkpointer(
        engine, checkpoint_root(cfg), cfg.checkpoint.keep, cfg.checkpoint.async_save,
        grid.checkpoint_group, cfg.checkpoint.trust,
    )  # fmt: skip


def save(cfg: Config, checkpoints: store.Checkpointer, state: dict, layout: Layout, step: int,
         consumed_tokens: int, vocab_size: int, tokenizer_path: Path, data: dict | None = None,
         wait: bool = True) -> Path:  # fmt: skip
    """Save a checkpoint at `step` (collective); `state` is this rank's `rank_state`,
    `data` the run's `data_state` (None: a run without a data stream, as in tests).
    `wait`: return once it is published (else, with checkpoint.async_save, once it is
    copied to host memory; `checkpoints.poll` publishes it later)."""
    info = CheckpointInfo(
        step=step, consumed_tokens=consumed_tokens, tensor=layout.tensor,
        pipeline=layout.pipeline, data=layout.data, zero_stage=cfg.parallel.zero_stage,
        vocab_size=vocab_size,
    )  # fmt: skip
    extra = {"config.yaml": cfg.to_yaml().encode(), "tokenizer.model": tokenizer_path.read_bytes()}
    if data is not None:
        buffer = io.BytesIO()
        torch.save(data, buffer)
        extra[DATA_STATE] = buffer.getvalue()
    client = {"universal_checkpoint_info": universal_info(cfg.model), "step": step}
    return checkpoints.save(info, state, extra, client, wait=wait)
