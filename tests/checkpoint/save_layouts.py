"""torchrun driver (not a test): several `belief-lm train` runs, one after another in one
job (start-up dominates on CPU), each recording the weights DeepSpeed holds at every save.

    torchrun --nproc_per_node=4 tests/checkpoint/save_layouts.py RUNS.json

RUNS.json: {"cache": DIR, "runs": {OUTPUT_DIR: [override, ...], ...}}. Each run is the
training command on configs/test/micro.yaml with its overrides, writing OUTPUT_DIR. When
the trainer saves step N, every rank also writes OUTPUT_DIR/live-N-rank<r>.pt: per
parameter (whole: tensor-parallel slices gathered; BeliefLM's names) the fp32 master
DeepSpeed's optimizer keeps (safe_get_full_fp32_param; None where it keeps none) and the
module's own weight (None under ZeRO-3, which partitions it away).

belief-lm refuses bf16 on a CPU (train.precision=bf16 needs a GPU in this project), but
DeepSpeed's bf16 engines run there with its CPU accelerator: this driver lifts that one
refusal (preflight's use_bf16), so runs with train.precision=bf16 save
real bf16 checkpoints: bf16 module weights beside fp32 masters.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

import belief_lm.preflight  # noqa: E402
from belief_lm.cli import main  # noqa: E402
from belief_lm.model.pipeline import canonical_name  # noqa: E402
from belief_lm.parallel.gather import gather_tensor_parallel  # noqa: E402
from belief_lm.train import trainer_state  # noqa: E402
from tests.jobs import MICRO  # noqa: E402


def bf16_anywhere(precision: str, device_type: str) -> bool:
    return precision == "bf16"


def whole(tensor, param):
    return None if tensor is None else gather_tensor_parallel(tensor.detach(), param).float()


def recording(save):
    def save_and_record(cfg, checkpoints, state, layout, step, *args):
        path = save(cfg, checkpoints, state, layout, step, *args)
        live = {"masters": {}, "weights": {}}
        for name, param in checkpoints.engine.module.named_parameters():
            if layout.pipeline > 1:
                name = canonical_name(name, cfg.model.num_layers)
            # collective under ZeRO-3 (every data-parallel rank gathers)
            live["masters"][name] = whole(safe_get_full_fp32_param(param), param)
            live["weights"][name] = None if hasattr(param, "ds_id") else whole(param, param)
        torch.save(live, f"{cfg.run.output_dir}/live-{step}-rank{dist.get_rank()}.pt")
        return path

    return save_and_record


def run(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    belief_lm.preflight.use_bf16 = bf16_anywhere
    trainer_state.save = recording(trainer_state.save)
    for output_dir, overrides in spec["runs"].items():
        # no loader worker processes: a later run's workers, forked from this process,
        # would inherit (and try to stop) the earlier run's
        code = main([
            "train", "--config", MICRO, f"run.output_dir={output_dir}",
            f"run.cache_dir={spec['cache']}", "data.num_workers=0", *overrides,
        ])  # fmt: skip
        if code != 0:
            sys.exit(code)


if __name__ == "__main__":
    run(sys.argv[1])
