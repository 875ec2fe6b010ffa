"""Moving a checkpoint to another layout: DeepSpeed universal checkpoints.

`ds_to_universal` merges every parameter's TP slices and ZeRO fragments (weights and Adam
moments) into whole fp32 tensors under <out>/zero/<parameter name>/; a job of any TP/PP/DP
then loads them with `checkpoint.load_universal`. It needs to know how each parameter was
sharded (`universal_info`, from the model's description: belief_lm.description), and it
names parameters as the saving model did, so we add the other naming next to each
(pipeline stages `3.self_attention...` and BeliefLM's `layers.2.self_attention...`): a
pipelined checkpoint can resume without a pipeline and the other way round.

The converter runs in a process of its own (`python -m belief_lm.checkpoint.universal`,
`main` below), which reads every file weights-only (loading.py) as this one does; the
universal files it writes are checked against the same allow-list before a job loads them
(a universal copy sits beside its checkpoint, outside its manifest).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from deepspeed.checkpoint import constants as ds

from belief_lm import compat
from belief_lm.checkpoint import loading
from belief_lm.checkpoint.files import CheckpointError, universal_path
from belief_lm.config import ModelConfig
from belief_lm.description import COLUMN, GATED, ROW, ModelDescription, Weight, describe
from belief_lm.model.pipeline import TIED_KEY, canonical_name, pipeline_name
from belief_lm.parallel.grid import ProcessGrid

log = logging.getLogger("belief_lm.checkpoint")


def universal_info(model: ModelConfig) -> dict:
    """How each parameter is sharded over TP ranks, in ds_to_universal's terms: regular
    expressions over both namings, one per weight of the model's description (a decoder
    layer's once, for every layer), listed under its split; column-parallel ones (dim 0)
    are the converter's default. The converter rejects patterns that match nothing, so
    only this model's weights are listed."""
    description = describe(model, vocab_size=0)  # names and splits: the sizes do not matter
    info = {
        ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        ds.TP_REPLICATED_PARAMETER_PATTERNS: [],
        ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [],
    }
    for weight, pattern in _patterns(description):
        if weight.split == COLUMN:
            continue
        if weight.split not in SPLIT_KEYS:
            raise ValueError(f"{weight.name}: split {weight.split} has no universal form")
        info.setdefault(SPLIT_KEYS[weight.split], []).append(pattern)
    if model.tie_embeddings:  # the output stage's copy of a tied embedding is the first's
        info[ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [rf"^tied_modules\.{TIED_KEY}\."]
    return info


SPLIT_KEYS = {
    None: ds.TP_REPLICATED_PARAMETER_PATTERNS,
    ROW: ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    GATED: ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,  # fc1 holds [gate_r; up_r] on each rank
}
"""universal_checkpoint_info's list for each split but COLUMN (its default)."""


def _patterns(description: ModelDescription) -> list[tuple[Weight, str]]:
    """Each weight of the description with a regular expression matching its name as
    BeliefLM and as the pipeline stages name it."""
    found = []
    for weight in (*description.embedding, *description.head):
        theirs = pipeline_name(weight.name, description.num_layers, description.tied)
        found.append((weight, rf"^({re.escape(weight.name)}|{re.escape(theirs)})$"))
    for weight in description.layer:  # layers.<i>.<name>, or <i + 1>.<name> in a pipeline
        found.append((weight, rf"^(layers\.\d+|\d+)\.{re.escape(weight.name)}$"))
    return found


def ensure_universal(
    checkpoint: Path, model: ModelConfig, grid: ProcessGrid, trust: bool = False
) -> Path:
    """The universal form of `checkpoint` beside it (`files.universal_path`), converted by
    rank 0 if it is not there yet while the other ranks wait (collective over `grid`), and
    its files checked against what a checkpoint may hold on every rank (RefusedFile on
    every rank alike; `trust`: a warning)."""
    output = universal_path(checkpoint)

    def convert_once() -> Path:
        if not (output / "run.json").exists():
            log.info("converting %s to the universal format", checkpoint)
            convert(checkpoint, output, model, trust=trust)
        return output

    grid.rank_zero_first(convert_once)
    loading.refuse(output, loading.refusals(output), trust)
    return output


TRUST_ARGUMENT = "--trust-checkpoint"
"""`main`'s own argument (the rest are ds_to_universal's): load files beyond the allow-list."""
REFUSED = 3
"""`main`'s exit code when a file was refused (RefusedFile; its message the last line)."""


def convert(
    checkpoint: Path, output: Path, model: ModelConfig, workers: int = 2, trust: bool = False
) -> Path:
    """Write the universal form of `checkpoint` to `output` (atomically: a temporary name
    renamed at the end) and add both parameter namings. Returns `output`. Every file is
    read weights-only (`trust`: see loading.load); a refused one raises RefusedFile."""
    tmp = output.with_name(f".tmp-{output.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    # A fresh process: the converter's worker pool forks, which can deadlock when forked
    # from a process whose torch.distributed threads are running.
    command = [
        sys.executable, "-m", "belief_lm.checkpoint.universal",
        "--input_folder", str(checkpoint), "--output_folder", str(tmp),
        "--num_extract_workers", str(workers), "--num_merge_workers", str(max(1, workers // 2)),
        *([TRUST_ARGUMENT] if trust else []),
    ]  # fmt: skip
    env = {**os.environ}
    if not trust:  # a worker that does not inherit main's loader still loads weights-only
        env["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode == REFUSED:
        shutil.rmtree(tmp, ignore_errors=True)
        raise loading.RefusedFile(done.stderr.strip().splitlines()[-1].removeprefix("belief-lm: "))
    if done.returncode != 0:
        raise CheckpointError(
            f"converting {checkpoint} to the universal format failed:\n{done.stderr[-3000:]}"
        )
    add_both_namings(tmp / "zero", model)
    for name in ("run.json", "config.yaml", "tokenizer.model", "data_state.pt"):
        if (checkpoint / name).exists():
            shutil.copyfile(checkpoint / name, tmp / name)
    shutil.copytree(checkpoint / "run_state", tmp / "run_state")
    shutil.rmtree(output, ignore_errors=True)
    os.replace(tmp, output)
    return output


def add_both_namings(zero_dir: Path, model: ModelConfig) -> None:
    """Link every parameter folder under its other name (BeliefLM <-> pipeline stages)."""
    for folder in [p for p in zero_dir.iterdir() if p.is_dir()]:
        name = folder.name
        if name[0].isdigit() or name.startswith("tied_modules."):
            other = canonical_name(name, model.num_layers)
        else:
            other = pipeline_name(name, model.num_layers, model.tie_embeddings)
        if other and other != name and not (zero_dir / other).exists():
            (zero_dir / other).symlink_to(folder.name, target_is_directory=True)


def main(argv: list[str]) -> int:
    """DeepSpeed's ds_to_universal (its arguments, and TRUST_ARGUMENT) with every file it
    reads loaded weights-only, its worker processes (forked) included."""
    from deepspeed.checkpoint import ds_to_universal

    trust = TRUST_ARGUMENT in argv
    sys.argv = [sys.argv[0], *(a for a in argv if a != TRUST_ARGUMENT)]
    args = ds_to_universal.parse_arguments()
    try:
        with compat.deepspeed_loads_through(functools.partial(loading.load, trust=trust)):
            ds_to_universal.main(args)
    except loading.RefusedFile as err:
        print(f"belief-lm: {err}", file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
