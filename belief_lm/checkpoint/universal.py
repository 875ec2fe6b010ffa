"""Moving a checkpoint to another layout: DeepSpeed universal checkpoints.

`ds_to_universal` merges every parameter's TP slices and ZeRO fragments (weights and Adam
moments) into whole fp32 tensors under <out>/zero/<parameter name>/; a job of any TP/PP/DP
then loads them with `checkpoint.load_universal`. It needs to know how each parameter was
sharded (`universal_info`), and it names parameters as the saving model did, so we add
the other naming next to each (pipeline stages `3.self_attention...` and BeliefLM's
`layers.2.self_attention...`): a pipelined checkpoint can resume without a pipeline and
the other way round.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from deepspeed.checkpoint import constants as ds

from belief_lm.checkpoint.files import CheckpointError, universal_path
from belief_lm.config import ModelConfig
from belief_lm.model.pipeline import TIED_KEY, canonical_name, pipeline_name
from belief_lm.parallel.grid import ProcessGrid

log = logging.getLogger("belief_lm.checkpoint")


def universal_info(model: ModelConfig) -> dict:
    """How each parameter is sharded over TP ranks, in ds_to_universal's terms (regular
    expressions over both namings; unmatched parameters are column-parallel: dim 0). The
    converter rejects patterns that match nothing, so only this model's are listed."""
    final_norm = rf"^(final_norm|{model.num_layers + 1})\.(weight|bias)$"
    replicated = [r".*layernorm\.(weight|bias)$", final_norm]
    if model.bias:
        replicated += [r".*linear_proj\.bias$", r".*linear_fc2\.bias$"]
    if model.position_embedding == "learned_absolute":
        replicated.append(r".*position_embeddings\.weight$")
    row_parallel = [r".*linear_proj\.weight$", r".*linear_fc2\.weight$"]
    if model.variant.extra_projection:
        row_parallel.append(r".*linear_proj\.w_s\.weight$")
    info = {
        ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        ds.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
        ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: row_parallel,
    }
    if model.activation == "swiglu":  # fc1 holds [gate_r; up_r] on each rank (stride 2)
        info[ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0] = [r".*linear_fc1\.(weight|bias)$"]
    if model.tie_embeddings:  # the output stage's copy of a tied embedding is the first's
        info[ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [rf"^tied_modules\.{TIED_KEY}\."]
    return info


def ensure_universal(checkpoint: Path, model: ModelConfig, grid: ProcessGrid) -> Path:
    """The universal form of `checkpoint` beside it (`files.universal_path`), converted by
    rank 0 if it is not there yet while the other ranks wait (collective over `grid`)."""
    output = universal_path(checkpoint)

    def convert_once() -> Path:
        if not (output / "run.json").exists():
            log.info("converting %s to the universal format", checkpoint)
            convert(checkpoint, output, model)
        return output

    return grid.rank_zero_first(convert_once)


def convert(checkpoint: Path, output: Path, model: ModelConfig, workers: int = 2) -> Path:
    """Write the universal form of `checkpoint` to `output` (atomically: a temporary name
    renamed at the end) and add both parameter namings. Returns `output`."""
    tmp = output.with_name(f".tmp-{output.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    # A fresh process: the converter's worker pool forks, which can deadlock when forked
    # from a process whose torch.distributed threads are running.
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(checkpoint), "--output_folder", str(tmp),
        "--num_extract_workers", str(workers), "--num_merge_workers", str(max(1, workers // 2)),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
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
