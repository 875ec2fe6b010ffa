"""A checkpoint as one model: its config, whole fp32 weights under BeliefLM's parameter
names, and its tokenizer, whatever layout saved it. What evaluation, generation, export
and downstream evaluation start from. Reading it needs no process group and builds no
model, so any process can do it (a plain `python`, one rank of any job).

The weights are the fp32 master copy wherever the run kept one:
- ZeRO 1/2, and DeepSpeed's bf16 optimizer (which keeps masters at ZeRO-0 with a pipeline
  too): each data-parallel rank's flat fp32 partition in its `*zero_pp_rank_*_optim_states.pt`
  file, cut where DeepSpeed's param_slice_mappings say (as its universal converter does);
- ZeRO-3: DeepSpeed's zero_to_fp32, once per tensor-parallel rank;
- ZeRO-0 otherwise: the module's weights, the only copy there is (in fp32 the optimizer
  updates them; in bf16 without a pipeline DeepSpeed updates the bf16 weights in place).
Model-parallel rank m holds pipeline stage m // TP and tensor-parallel slice m % TP (TP
innermost); the slices are joined as the model's description (belief_lm.description)
splits each weight, and pipeline names are mapped to BeliefLM's.

Every file is read weights-only (loading.py), DeepSpeed's zero_to_fp32 included, and
before any is read the checkpoint is refused if one of DeepSpeed's files (the only ones read
here) holds more than a checkpoint may.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from deepspeed.checkpoint import constants as ds

from belief_lm import compat
from belief_lm.checkpoint import loading
from belief_lm.checkpoint.files import (
    CheckpointError,
    CheckpointInfo,
    damaged,
    named_checkpoint,
    problems,
    read_info,
)
from belief_lm.config import Config, ModelConfig
from belief_lm.description import Weight, describe
from belief_lm.model.gpt import BeliefLM
from belief_lm.model.pipeline import canonical_name
from data_pipeline.tokenizer import Tokenizer

log = logging.getLogger("belief_lm.checkpoint")

Slices = dict[str, list[torch.Tensor]]
"""BeliefLM name -> the tensor-parallel slices of one parameter, in TP-rank order."""


@dataclass
class Consolidated:
    """Everything needed to rebuild the trained model in one process."""

    path: Path
    info: CheckpointInfo
    config: Config
    state_dict: dict[str, torch.Tensor]
    """Whole fp32 tensors keyed by BeliefLM's parameter names."""
    tokenizer_path: Path

    def build_model(self, tensor_parallel: int = 1) -> BeliefLM:
        """BeliefLM at TP=1 with these weights (eval mode, fp32, CPU). Needs megatron's
        process groups, as any BeliefLM (belief_lm.parallel.grid.ProcessGrid.single_process)."""
        if tensor_parallel != 1:
            raise ValueError("build_model builds a single-process (TP=1) model")
        eos_id = Tokenizer(self.tokenizer_path).eos_id  # where documents end, if masked
        model = BeliefLM(
            self.config.model, self.info.vocab_size, seed=self.config.run.seed, eos_id=eos_id
        )
        load_full_state(model, self.state_dict)
        return model.eval()


def load_full_state(
    model: torch.nn.Module,
    state: dict[str, torch.Tensor],
    rename: Callable[[str], str] | None = None,
) -> None:
    """Copy whole tensors into `model` (sharded to this rank's slice under tensor
    parallelism); every parameter must be present with the right full shape. `rename`
    maps the model's parameter names to the keys of `state` (a pipeline stage's names to
    BeliefLM's: belief_lm.model.pipeline.canonical_name)."""
    from belief_lm.parallel.gather import shard_tensor_parallel

    keys = {name: rename(name) if rename else name for name, _ in model.named_parameters()}
    missing = [key for key in keys.values() if key not in state]
    if missing:
        raise CheckpointError(f"the checkpoint has no weights for {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_tensor_parallel(state[keys[name]].to(param.dtype), param))


def consolidate(path: str | Path, verify: bool = True, trust: bool = False) -> Consolidated:
    """Read checkpoint `path` (a step directory; a run directory: its newest intact
    checkpoint) as a Consolidated model. `verify`: first
    check every file against the manifest (read through once; CheckpointError naming the
    file if one differs) and against what a checkpoint may hold (RefusedFile naming it);
    off only where the caller verified it. `trust`: load files beyond that with pickle
    (loading.load), after a warning."""
    if trust:
        log.warning(
            "--trust-checkpoint: a file of the checkpoint holding more than a checkpoint may "
            "is loaded with pickle, which can run any code it holds"
        )
    path, judged = named_checkpoint(Path(path).expanduser(), checksums=verify)
    info = read_info(path)
    if verify and not judged:
        found = problems(path, checksums=True)
        if found:
            raise damaged(path, found)
    if verify:  # DeepSpeed's files, every one of which is read below (none of the rest)
        names = sorted(p.name for p in path.glob("*_states.pt"))
        loading.refuse(path, loading.refusals(path, names), trust)
    load = functools.partial(loading.load, trust=trust)
    try:
        config = Config.model_validate(yaml.safe_load((path / "config.yaml").read_text()))
    except (OSError, yaml.YAMLError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: unusable config.yaml ({err})") from None
    tokenizer = path / "tokenizer.model"
    if not tokenizer.is_file():
        raise CheckpointError(f"checkpoint {path} has no tokenizer.model")
    masters = any(path.glob("*_optim_states.pt"))
    if info.zero_stage > 0 and not masters:
        raise CheckpointError(f"checkpoint {path} (ZeRO {info.zero_stage}) has no optimizer files")
    slices: Slices = defaultdict(list)
    for tp_rank in range(info.tensor):
        if info.zero_stage == 3:  # no pipeline: model-parallel rank = TP rank
            stages = [_zero3_masters(path, tp_rank, load)]
        else:
            module = _module_slice(path, tp_rank, info, config.model, load)
            stages = [module]
            if masters:
                ranks = [stage * info.tensor + tp_rank for stage in range(info.pipeline)]
                stages = [
                    _partitioned_masters(path, r, info, config.model, module, load) for r in ranks
                ]
        whole_slice: dict[str, torch.Tensor] = {}
        for stage in stages:  # a tied embedding is on two stages: the first one's
            for name, tensor in stage.items():
                whole_slice.setdefault(name, tensor)
        for name, tensor in whole_slice.items():
            slices[name].append(tensor.float())
    described = {w.name: w for w in describe(config.model, info.vocab_size).weights()}
    state = {name: _join(path, name, parts, described) for name, parts in slices.items()}
    return Consolidated(path, info, config, state, tokenizer)


def _module_slice(
    path: Path, tp_rank: int, info: CheckpointInfo, model: ModelConfig, load: Callable
) -> dict[str, torch.Tensor]:
    """Tensor-parallel slice `tp_rank` of the module's weights (every stage's): DeepSpeed's
    model-state file, or with a pipeline the layer files `layer_<index>-model_<tp rank>`."""
    if info.pipeline == 1:
        file = path / compat.model_states_name(tp_rank)
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} has no {file.name}")
        return _canonical(load(file, "cpu")["module"], info, model)
    layers = sorted(path.glob(compat.layer_states_pattern(tp_rank)))
    if not layers:
        raise CheckpointError(f"checkpoint {path} has no layer files of tensor rank {tp_rank}")
    state = {}
    for file in layers:
        index = compat.layer_index(file.name)
        state.update({f"{index}.{key}": value for key, value in load(file, "cpu").items()})
    return _canonical(state, info, model)


def _partitioned_masters(
    path: Path, rank: int, info: CheckpointInfo, model: ModelConfig, module: dict, load: Callable
) -> dict[str, torch.Tensor]:
    """Model-parallel rank `rank`'s fp32 masters from ZeRO-1/2 or bf16-optimizer files: its
    data-parallel ranks' flat fp32 partitions, cut where DeepSpeed's param_slice_mappings
    say and shaped like the module's weights. (DeepSpeed's zero_to_fp32 reads neither a
    pipeline's model-state files nor bf16-optimizer files without ZeRO; its universal
    converter reads the same mappings, but not the latter either.)"""
    files = sorted(
        path.glob(compat.optim_states_pattern(rank)), key=lambda f: compat.zero_rank(f.name)
    )
    if len(files) != info.data:
        raise CheckpointError(
            f"checkpoint {path}: {len(files)} optimizer files of model-parallel rank {rank}, "
            f"expected one per data-parallel rank ({info.data})"
        )
    pieces = defaultdict(list)  # name -> its fragments, in data-parallel rank order
    for file in files:
        state = load(file, "cpu", mmap=True)
        optimizer = state[ds.OPTIMIZER_STATE_DICT]
        groups = zip(
            optimizer[ds.SINGLE_PARTITION_OF_FP32_GROUPS], optimizer[ds.PARAM_SLICE_MAPPINGS],
            strict=True,
        )  # fmt: skip
        for flat, fragments in groups:
            for name, fragment in fragments.items():
                pieces[name].append(flat.narrow(0, fragment.start, fragment.numel))
    flat = _canonical({name: torch.cat(parts) for name, parts in pieces.items()}, info, model)
    return {name: tensor.view(module[name].shape) for name, tensor in flat.items()}


def _zero3_masters(path: Path, rank: int, load: Callable) -> dict[str, torch.Tensor]:
    """Model-parallel rank `rank`'s fp32 masters from ZeRO-3 files, merged over its
    data-parallel ranks by DeepSpeed's zero_to_fp32 (which reads every file of a
    directory: it is given a view of this rank's files, and reads them through `load`)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with tempfile.TemporaryDirectory(prefix="consolidate-") as tmp:
        view = Path(tmp) / path.name
        view.mkdir()
        for file in path.glob(compat.optim_states_pattern(rank, kind="*")):
            (view / file.name).symlink_to(file.resolve())
        # stdout belongs to the commands' output (generated text, JSON): its prints go aside
        with contextlib.redirect_stdout(sys.stderr), compat.deepspeed_loads_through(load):
            try:
                return get_fp32_state_dict_from_zero_checkpoint(tmp, tag=path.name)
            except loading.RefusedFile:
                raise
            except (FileNotFoundError, ValueError) as err:
                raise CheckpointError(
                    f"checkpoint {path}: model-parallel rank {rank}: {err}"
                ) from None


def _canonical(state: dict, info: CheckpointInfo, model: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` under BeliefLM's names (pipeline names mapped), without megatron's empty
    `_extra_state` entries."""
    rename = (lambda n: canonical_name(n, model.num_layers)) if info.pipeline > 1 else None
    return {
        rename(name) if rename else name: tensor
        for name, tensor in state.items()
        if not name.endswith("_extra_state")
    }


def _join(path: Path, name: str, parts: list[torch.Tensor], described: dict[str, Weight]):
    """The whole parameter from its tensor-parallel slices, joined as the description
    splits it: replicated (any slice), or along its split's dim (a SwiGLU fc1 holds
    [gate_r; up_r] on each rank)."""
    from belief_lm.parallel.gather import join_shards

    if name not in described:
        raise CheckpointError(f"checkpoint {path}: parameter {name} is not in its config's model")
    split = described[name].split
    if len(parts) == 1 or split is None:
        return parts[0]
    return join_shards(parts, split.dim, split.stride)
