"""Every check of a run that needs no work, in one place and without torch.

`preflight(cfg, world_size)` is what `train`, `launch local`, `launch slurm` and `config`
run before anything starts: the layout arithmetic (world = TP x PP x DP, the global batch
from micro-batches and accumulation), what DeepSpeed's engines can run, the precision on
this device kind, and whether the checkpoint a resume would load fits this run. A job that
passes here does not fail at start-up for one of these reasons, and one that would is
refused before it waits in a queue. (torchtitan's ParallelDims plays the same part.)
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from belief_lm.checkpoint.files import (
    CheckpointError,
    CheckpointInfo,
    damaged,
    newest_checkpoint,
    problems,
    read_info,
    step_dirs,
)
from belief_lm.config import Config
from belief_lm.errors import BadInput
from belief_lm.parallel.dims import ParallelDims

RUNTIME_ONLY = {
    "model": {"name", "fused_output_projection", "compile"},
    "data": {"num_workers", "max_skipped_fraction", "skip_check_min_rows", "on_corrupt_row_group"},
}
"""Keys that do not change the architecture or the data's order (free to differ on resume)."""


@dataclass(frozen=True)
class ResumeFrom:
    """The checkpoint a run continues from, and whether it needs the universal path."""

    path: Path
    info: CheckpointInfo
    other_layout: bool
    trusted: bool = False
    """Whether files beyond what a checkpoint may hold are loaded (checkpoint.trust)."""
    branch: bool = False
    """Another run's checkpoint (checkpoint.branch): the run takes this config's schedule."""


@dataclass(frozen=True)
class Preflight:
    """What pre-flight worked out: the layout, the accumulation, the precision, the resume."""

    dims: ParallelDims
    grad_accumulation: int
    """Micro-batches per optimizer step on each data-parallel rank."""
    bf16: bool | None
    """Whether the run computes in bf16 (None: the device is not known yet)."""
    resume: ResumeFrom | None


def preflight(cfg: Config, world_size: int, device_type: str | None = None) -> Preflight:
    """Check `cfg` for a job of `world_size` processes on `device_type` ('cuda', 'cpu', or
    None when not known yet, as at submission). Raises BadInput (CheckpointError for the
    checkpoint) naming the options to change."""
    dims, accumulation = check_layout(cfg, world_size)
    check_eval_tasks(cfg)
    check_wandb(cfg)
    bf16 = None if device_type is None else use_bf16(cfg.train.precision, device_type)
    return Preflight(dims, accumulation, bf16, resume_from(cfg, dims))


def check_layout(cfg: Config, world_size: int) -> tuple[ParallelDims, int]:
    """The layout's checks: parallel sizes, engine limits, head split, batch and readers.
    Returns the layout's numbers and the accumulation steps; raises BadInput naming the
    options to change. (`belief-lm plan` asks this of every layout it considers.)"""
    check_engine_settings(cfg)  # the config alone first, then against the job's size
    dims = ParallelDims(world_size, cfg.parallel.tensor, cfg.parallel.pipeline)
    check_tensor_split(cfg)
    accumulation = grad_accumulation_steps(cfg, dims.data)
    check_readers(cfg, dims.data)
    return dims, accumulation


def grad_accumulation_steps(cfg: Config, data_parallel: int) -> int:
    """Micro-batches per optimizer step on each rank: global / (micro x data-parallel)."""
    per_step = cfg.train.micro_batch_size * data_parallel
    batch = cfg.train.global_batch_size
    if batch % per_step:
        micro = [
            m for m in range(1, batch // data_parallel + 1) if batch % (m * data_parallel) == 0
        ]
        raise BadInput(
            f"train.global_batch_size ({batch}) must be a multiple of "
            f"train.micro_batch_size ({cfg.train.micro_batch_size}) x data-parallel size "
            f"({data_parallel}); micro-batch sizes that work here: "
            f"{', '.join(map(str, micro)) or 'none (the data-parallel size does not divide it)'}"
        )
    return batch // per_step


def check_readers(cfg: Config, data_parallel: int) -> None:
    """Every step takes global_batch / readers windows from every reader, and a reader
    lives on one data-parallel rank: readers must divide the global batch and be shared
    evenly by the data-parallel ranks."""
    batch = cfg.train.global_batch_size
    count = cfg.data.readers_for(batch)
    if batch % count:
        raise BadInput(f"data.readers ({count}) must divide train.global_batch_size ({batch})")
    if count % data_parallel:
        sizes = [d for d in range(1, count + 1) if count % d == 0]
        raise BadInput(
            f"the data-parallel size ({data_parallel}) must divide the run's {count} data "
            f"readers (data.readers); data-parallel sizes that work: "
            f"{', '.join(map(str, sizes))}"
        )


def check_engine_settings(cfg: Config) -> None:
    """Combinations DeepSpeed or the model cannot run, refused before any work."""
    parallel, model = cfg.parallel, cfg.model
    if parallel.pipeline > 1 and parallel.zero_stage > 1:
        raise BadInput(
            f"parallel.zero_stage={parallel.zero_stage} cannot be combined with "
            f"parallel.pipeline={parallel.pipeline}: DeepSpeed's pipeline engine "
            "supports ZeRO stage 0 or 1"
        )
    if parallel.pipeline > 1 and cfg.train.spike.action == "skip":
        raise BadInput(
            f"train.spike.action=skip cannot be combined with parallel.pipeline="
            f"{parallel.pipeline}: DeepSpeed's pipeline engine applies the update inside "
            "train_batch, where the loss is judged but a skip is not built, so a spike "
            "cannot be kept from the weights; use action log or stop"
        )
    if model.compile == "layer" and parallel.zero_stage == 3:
        raise BadInput(
            f"model.compile={model.compile} cannot be combined with parallel.zero_stage=3: "
            "ZeRO-3 gathers each module's weights in hooks around its forward, and "
            "torch.compile traces the layer with the weights still partitioned (empty); "
            "use ZeRO stage 0-2 or model.compile=none"
        )
    if parallel.pipeline > model.num_layers:
        raise BadInput(
            f"parallel.pipeline ({parallel.pipeline}) exceeds model.num_layers "
            f"({model.num_layers}): every stage needs a decoder layer"
        )


def check_tensor_split(cfg: Config) -> None:
    """Tensor parallelism splits the heads and KV groups over its ranks: they must divide."""
    parallel, model = cfg.parallel, cfg.model
    for name, count in (("num_attention_heads", model.num_attention_heads),
                        ("query groups (num_query_groups)", model.query_groups)):  # fmt: skip
        if count % parallel.tensor:
            raise BadInput(
                f"model.{name} ({count}) is not divisible by parallel.tensor "
                f"({parallel.tensor}): heads are split over tensor-parallel ranks"
            )


def check_eval_tasks(cfg: Config) -> None:
    """train.eval_tasks need lm-evaluation-harness (the `eval` extra) and their local task
    files. (Task names are resolved by lm-eval when the run starts: that takes seconds.)"""
    if not cfg.train.eval_tasks:
        return
    try:
        import lm_eval  # noqa: F401  (cheap: lm-eval imports its parts lazily)
    except ImportError:
        raise BadInput(
            "train.eval_tasks needs lm-evaluation-harness, which is not installed: "
            "pip install 'belief-lm[eval]'"
        ) from None
    for task in cfg.train.eval_tasks:
        if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
            raise BadInput(f"train.eval_tasks: task file {task} does not exist")


def check_wandb(cfg: Config) -> None:
    """run.wandb needs Weights & Biases (the `wandb` extra); looked up, not imported."""
    if cfg.run.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise BadInput(
            f"run.wandb.mode={cfg.run.wandb.mode} needs Weights & Biases, which is not "
            "installed: pip install 'belief-lm[wandb]' (or run.wandb.mode=disabled)"
        )


def use_bf16(precision: str, device_type: str) -> bool:
    """Resolve train.precision on a device kind (auto: bf16 on GPU, fp32 on CPU)."""
    if precision == "bf16" and device_type != "cuda":
        raise BadInput("train.precision=bf16 needs a GPU; use fp32 or auto on CPU")
    return precision == "bf16" or (precision == "auto" and device_type == "cuda")


def checkpoint_root(cfg: Config) -> Path:
    """Where a run keeps its checkpoints."""
    return Path(cfg.run.output_dir).expanduser() / "checkpoints"


def resume_from(cfg: Config, dims: ParallelDims, skip: Collection[Path] = ()) -> ResumeFrom | None:
    """The checkpoint `checkpoint.resume` picks, checked against this run: intact (every
    file there with its size; the checksums are the trainer's, `verified_resume`), the same
    model and data, and a layout change its weights and optimizer state can make. None for
    a fresh start. With resume=auto a damaged checkpoint is passed over with a warning (and
    those in `skip`, found damaged already); a run directory with checkpoints but none
    intact is refused rather than started over."""
    choice, branch = cfg.checkpoint.resume, cfg.checkpoint.branch
    if branch is not None:
        check_branch(cfg)
    if choice == "never":
        return None
    branching = False
    if choice == "auto":
        root = checkpoint_root(cfg)
        path = newest_checkpoint(root, skip=skip)
        if path is None:
            if step_dirs(root):
                raise CheckpointError(
                    f"no intact checkpoint in {root} (each is damaged: see the warnings, or "
                    f"`belief-lm checkpoint verify {root}`); resume one by name to see why, "
                    "or start over with checkpoint.resume=never"
                )
            if branch is None:
                return None
            path, branching = branch_checkpoint(cfg), True
    else:
        path = Path(choice).expanduser()
        found = problems(path) if path.is_dir() else []  # (read_info names a missing one)
        if found:
            raise damaged(path, found)
    info = read_info(path)
    check_same_run(cfg, path)
    trusted = cfg.checkpoint.trust
    if branching and info.weights_only:
        raise CheckpointError(
            f"checkpoint.branch={path} holds weights alone (an import): a branch continues a "
            "run's optimizer and data; start from it with checkpoint.resume instead"
        )
    if info.weights_only:  # weights alone (an import): any layout loads them, nothing else
        return ResumeFrom(path, info, other_layout=False, trusted=trusted)
    zero = cfg.parallel.zero_stage
    moved = (info.tensor, info.pipeline, info.zero_stage) != (dims.tensor, dims.pipeline, zero)
    # ZeRO 1-3 partition the optimizer (and more) over the data-parallel ranks
    other_layout = moved or (info.data != dims.data and zero > 0)
    if other_layout and (zero not in (1, 2) or info.zero_stage not in (1, 2)):
        raise CheckpointError(
            f"resuming checkpoint {path} (ZeRO {info.zero_stage}, TP{info.tensor} x "
            f"PP{info.pipeline}) on another layout goes through DeepSpeed's universal "
            f"checkpoints, which need ZeRO stage 1 or 2 on both sides "
            f"(parallel.zero_stage={cfg.parallel.zero_stage})"
        )
    return ResumeFrom(path, info, other_layout, trusted, branching)


def check_branch(cfg: Config) -> None:
    """checkpoint.branch must name another run directory's checkpoint, with resume=auto."""
    branch, choice = cfg.checkpoint.branch, cfg.checkpoint.resume
    if choice != "auto":
        raise BadInput(
            f"checkpoint.branch={branch} starts this run from another run's checkpoint and "
            f"needs checkpoint.resume=auto (not {choice!r})"
        )
    if Path(branch).expanduser().resolve().is_relative_to(checkpoint_root(cfg).resolve()):
        raise BadInput(
            f"checkpoint.branch={branch} is a checkpoint of this run (run.output_dir="
            f"{cfg.run.output_dir}): a branch needs a run directory of its own"
        )


def branch_checkpoint(cfg: Config) -> Path:
    """checkpoint.branch's checkpoint, intact (every file there with its size)."""
    path = Path(cfg.checkpoint.branch).expanduser()
    found = problems(path) if path.is_dir() else []  # (read_info names a missing one)
    if found:
        raise damaged(path, found)
    return path


def check_same_run(cfg: Config, path: Path) -> None:
    """The model and data sections must be the ones checkpoint `path` was trained with."""
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError) as err:  # ValueError: not UTF-8
        raise CheckpointError(f"checkpoint {path}: unreadable config.yaml ({err})") from None
    sections = ("model", "data", "train")
    if not isinstance(saved, dict) or not all(isinstance(saved.get(s, {}), dict) for s in sections):
        raise CheckpointError(f"checkpoint {path}: config.yaml is not a belief-lm config")
    current = cfg.model_dump(mode="json")
    for section in ("model", "data"):
        old = saved.get(section, {})
        # options added since the checkpoint was saved read as their defaults (one since
        # removed or changed fails validation: the section is compared as saved)
        with contextlib.suppress(ValidationError):
            old = type(getattr(cfg, section)).model_validate(old).model_dump(mode="json")
        differ = sorted(
            f"{section}.{k} (checkpoint: {old.get(k)!r}, now: {v!r})"
            for k, v in current[section].items()
            if old.get(k) != v and k not in RUNTIME_ONLY[section]
        )
        if differ:
            raise CheckpointError(
                f"checkpoint {path} was trained with a different {section} config: "
                + "; ".join(differ)
            )
    batch = saved.get("train", {}).get("global_batch_size")
    if batch != cfg.train.global_batch_size:
        raise CheckpointError(
            f"checkpoint {path} was trained with train.global_batch_size={batch}, this run "
            f"has {cfg.train.global_batch_size}: a run keeps its global batch (the data order "
            "is laid out in it); the micro-batch size and the layout may change"
        )
