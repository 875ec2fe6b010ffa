"""Writing checkpoints atomically and verifiably, now or in the background, and the RNG
states they carry (the files on disk are described in `files.py`).

A checkpoint is written under `.tmp-step_000100`: every rank writes its files through its
`CheckpointWriter` (writer.py), which records each file's size and CRC-32. Once every rank
has written its files, rank 0 gathers their records, writes `manifest.json`, then
`run.json`, renames the directory to `step_000100`, and only then replaces `latest`
(atomically). A crash at any moment leaves `latest` on a complete checkpoint; a directory
without a complete run.json is never loaded, and one whose files differ from its manifest
is never trusted (files.problems). Older checkpoints beyond `keep` intact ones are deleted
last.

With `background=True` (checkpoint.async_save) a save only copies the state to host memory
and returns; training continues while the writer threads write, and the ranks agree that
every one of them is done at a later step boundary (`poll`: one small all-reduce per step
while a save is in flight), at the next save, or when training ends (`wait`). Until then
nothing is published: a job killed meanwhile resumes from the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from belief_lm import compat
from belief_lm.checkpoint.files import (
    LATEST,
    CheckpointError,
    CheckpointInfo,
    problems,
    step_dirs,
    step_name,
    universal_path,
)
from belief_lm.checkpoint.manifest import (
    ChecksummingFile,
    FileRecord,
    bytes_record,
    file_record,
    write_file,
    write_manifest,
)
from belief_lm.checkpoint.writer import CheckpointWriter, install

log = logging.getLogger("belief_lm.checkpoint")


def rng_state() -> dict:
    """This process's RNG states as plain values and tensors (what a checkpoint may hold:
    loading.py): Python's is a tuple of ints, NumPy's key array a tensor."""
    name, key, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(name), "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(position), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s (or an earlier belief-lm's, whose NumPy state was NumPy's
    own tuple)."""
    random.setstate(state["python"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        key = saved["key"].numpy().astype(np.uint32)
        saved = (saved["bit_generator"], key, saved["pos"], saved["has_gauss"],
                 saved["cached_gaussian"])  # fmt: skip
    np.random.set_state(saved)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointWriteError(RuntimeError):
    """A rank failed to write its files of a checkpoint (raised on every rank)."""


@dataclass
class Pending:
    """A checkpoint being written, not yet published."""

    tmp: Path
    final: Path
    info: CheckpointInfo
    extra_files: dict[str, bytes]
    started: float
    """time.perf_counter() when the save began."""
    background: bool
    """Whether its files are written in the background."""


class Checkpointer:
    """Saves the checkpoints of one DeepSpeed engine under `root`, keeping the newest
    `keep` intact ones. Collective: every rank makes one and calls its methods at the same
    points. `background`: write in the background (see the module docstring); `group`:
    the host-side (gloo) group the ranks agree in (the process grid's checkpoint_group;
    None in a job of one process). `trust`: the engine's loads of files beyond what a
    checkpoint may hold go ahead with pickle (loading.load)."""

    def __init__(
        self,
        engine,
        root: Path,
        keep: int,
        background: bool = False,
        group: dist.ProcessGroup | None = None,
        trust: bool = False,
    ):
        if group is None and dist.get_world_size() > 1:
            raise ValueError(
                "a checkpointer of a job of several processes needs the grid's checkpoint group"
            )
        self.engine = engine
        self.root = root
        self.keep = keep
        self.writer = CheckpointWriter(background, trust)
        install(engine, self.writer)
        self.pending: Pending | None = None
        self.group = group

    def save(
        self,
        info: CheckpointInfo,
        rank_state: dict,
        extra_files: dict[str, bytes],
        client_state: dict,
        wait: bool = True,
    ) -> Path:
        """Write a checkpoint of the engine at `info.step` and return its path. `rank_state`
        is this rank's (RNG states and the like); `extra_files` are written by rank 0
        (config, tokenizer, data position). A save still in flight is published first.
        `wait` (or a writer that is not in the background): return once it is published."""
        self.wait()
        started = time.perf_counter()
        rank = dist.get_rank()
        final = self.root / step_name(info.step)
        tmp = self.root / f".tmp-{final.name}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
            self.root.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        background = self.writer.background and not wait
        with self.writer.saving(background):
            self.engine.save_checkpoint(
                str(self.root), tag=tmp.name, client_state=client_state, save_latest=False
            )
            self.writer.save(rank_state, str(tmp / "run_state" / f"rank{rank:05d}.pt"))
        extra = extra_files if rank == 0 else {}
        self.pending = Pending(tmp, final, info, extra, started, background)
        if not background:
            return self.wait()
        log.info(
            "checkpoint %s: copied to host memory in %.2f s (the pause training takes); "
            "writing it in the background", final.name, time.perf_counter() - started,
        )  # fmt: skip
        return final

    def poll(self) -> Path | None:
        """Publish the save in flight if every rank has written its files; its path if it
        was published now. Collective: one small all-reduce while a save is in flight,
        nothing otherwise."""
        if self.pending is None or not self._every_rank_done(self.writer.done()):
            return None
        return self._publish()

    def wait(self) -> Path | None:
        """Wait for the save in flight (every rank's files) and publish it; its path, or
        None if there was none. Collective."""
        if self.pending is None:
            return None
        if not self.writer.done():
            log.info("waiting for the background save of %s", self.pending.final.name)
        self.writer.join()
        self._every_rank_done(True)
        return self._publish()

    def close(self) -> None:
        """Let this rank's writes in flight end (not collective: nothing is published). For
        a run ending with an error: its files end complete, the checkpoint unpublished."""
        self.writer.join()

    def _every_rank_done(self, done: bool) -> bool:
        """Whether every rank's writes have ended (one all-reduce of two flags); raises
        CheckpointWriteError on every rank if a rank failed to write."""
        failure = self.writer.failure() if done else None
        flags = torch.tensor([0 if done else 1, 0 if failure is None else 1])
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        if flags[1]:
            pending, self.pending = self.pending, None
            self.writer.join()
            self.writer.take_records()
            where = f": {failure}" if failure is not None else " on another rank (see its log)"
            raise CheckpointWriteError(f"writing checkpoint {pending.tmp} failed{where}")
        return not flags[0]

    def _publish(self) -> Path:
        """Gather the ranks' records; rank 0 publishes (collective)."""
        pending, self.pending = self.pending, None
        records = {
            os.path.relpath(path, pending.tmp): record
            for path, record in self.writer.take_records().items()
        }
        every_rank = [records]
        if dist.get_world_size() > 1:
            every_rank = [None] * dist.get_world_size()
            dist.all_gather_object(every_rank, records, group=self.group)
        failure = None
        if dist.get_rank() == 0:
            merged = {name: r for part in every_rank for name, r in part.items()}
            try:
                publish(pending.tmp, pending.final, pending.info, merged, pending.extra_files)
            except Exception as err:  # told to every rank below, then raised
                failure = err
        outcome = [None if failure is None else str(failure)]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(outcome, src=0, group=self.group)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise CheckpointWriteError(f"publishing {pending.final} failed on rank 0: {outcome[0]}")
        how = " (written in the background)" if pending.background else ""
        # how long a stop signal's save takes: the grace period a cluster must give (README)
        seconds = time.perf_counter() - pending.started
        log.info("saved checkpoint %s in %.1f s%s", pending.final, seconds, how)
        if dist.get_rank() == 0:
            delete_old(self.root, self.keep)
        return pending.final


def save(
    engine,
    root: Path,
    info: CheckpointInfo,
    rank_state: dict,
    extra_files: dict[str, bytes],
    client_state: dict,
    keep: int,
) -> Path:
    """Write a checkpoint of `engine` now (collective) and return its path: a
    `Checkpointer`'s save, for a one-off."""
    return Checkpointer(engine, root, keep).save(info, rank_state, extra_files, client_state)


def save_weights(
    root: Path, info: CheckpointInfo, weights: dict[str, torch.Tensor], extra_files: dict
) -> Path:
    """Write a weights-only checkpoint (files.py) from one process, without an engine:
    `weights` (whole tensors under BeliefLM's names) in DeepSpeed's model file of a
    one-process run, atomically as `save` writes. Returns its path."""
    final = root / step_name(info.step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    name = compat.model_states_name(0)
    with open(tmp / name, "wb") as file:
        out = ChecksummingFile(file)
        torch.save({"module": weights}, out)
        file.flush()
        os.fsync(file.fileno())
    publish(tmp, final, info, {name: out.record()}, extra_files)
    return final


def publish(
    tmp: Path,
    final: Path,
    info: CheckpointInfo,
    records: dict[str, FileRecord],
    extra_files: dict[str, bytes],
) -> None:
    """Complete checkpoint `tmp`, whose files the ranks wrote as `records` say: its extra
    files, manifest.json, then run.json; rename it to `final` and point `latest` at it."""
    records = dict(records)
    for name, content in extra_files.items():
        records[name] = write_file(tmp / name, content)
    on_disk = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()}
    lost = sorted(records.keys() - on_disk)
    if lost:  # e.g. a rank wrote to storage rank 0 does not see
        raise CheckpointError(f"{tmp}: files written by a rank are not there: {lost[:5]}")
    for name in sorted(on_disk - records.keys()):  # written outside the checkpoint engine
        records[name] = file_record(tmp / name)
    run_json = json.dumps(asdict(info), indent=2).encode()
    records["run.json"] = bytes_record(run_json)
    write_manifest(tmp, records)
    write_file(tmp / "run.json", run_json)
    if final.exists():  # re-saving a step (e.g. resumed and stopped at once)
        shutil.rmtree(final)
    # a universal copy converted from the old weights of this step would be reused
    shutil.rmtree(universal_path(final), ignore_errors=True)
    os.replace(tmp, final)
    _write_atomic(final.parent / LATEST, final.name)


def delete_old(root: Path, keep: int) -> None:
    """Delete the checkpoints older than the newest `keep` intact ones (sizes checked), and
    their universal copies. The newest intact checkpoints are never deleted, however many
    damaged ones are newer."""
    intact = [(step, path) for step, path in step_dirs(root) if not problems(path)]
    if not intact:
        return
    oldest_kept = intact[-keep:][0][0]
    for step, path in step_dirs(root):
        if step < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(universal_path(path), ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
