"""torchrun driver (not a test): `belief-lm train` in bf16 on the CPU, one layout after
another in one job, recording the optimizer's fp32 master weights at every save.

    torchrun --nproc_per_node=4 tests/checkpoint/bf16_runs.py OUT CACHE TP,PP,ZERO [TP,PP,ZERO ...]

belief-lm refuses bf16 on a CPU (train.precision=bf16 needs a GPU in this project), but
DeepSpeed's bf16 engines run there with the CPU accelerator; this driver lifts the refusal
(preflight's and the engine's use_bf16) and runs the real training command otherwise
unchanged (tokenizer cache CACHE), writing OUT/<tp>-<pp>-<zero>/ (a run directory). When the trainer saves, every
rank also writes masters-rank<r>.pt there: each parameter's full fp32 master as DeepSpeed
holds it (safe_get_full_fp32_param; the bf16 weight itself where DeepSpeed keeps no
master), tensor-parallel slices gathered, under BeliefLM's names.
"""

from __future__ import annotations

import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

import belief_lm.preflight  # noqa: E402
import belief_lm.train.engine  # noqa: E402
from belief_lm.cli import main  # noqa: E402
from belief_lm.model.pipeline import canonical_name  # noqa: E402
from belief_lm.parallel.gather import gather_tensor_parallel  # noqa: E402
from belief_lm.train import checkpointing  # noqa: E402
from tests.jobs import MICRO  # noqa: E402


def bf16_anywhere(precision: str, device_type: str) -> bool:
    return precision == "bf16"


def recording_masters(save):
    def save_and_record(cfg, engine, state, layout, *args, **kwargs):
        path = save(cfg, engine, state, layout, *args, **kwargs)
        masters = {}
        for name, param in engine.module.named_parameters():
            master = safe_get_full_fp32_param(param)  # collective under ZeRO-3
            full = gather_tensor_parallel(param.detach() if master is None else master, param)
            if layout.pipeline > 1:
                name = canonical_name(name, cfg.model.num_layers)
            masters[name] = full.float()
        torch.save(masters, f"{cfg.run.output_dir}/masters-rank{dist.get_rank()}.pt")
        return path

    return save_and_record


def run(out: str, cache: str, layouts: list[str]) -> None:
    belief_lm.preflight.use_bf16 = belief_lm.train.engine.use_bf16 = bf16_anywhere
    checkpointing.save = recording_masters(checkpointing.save)
    for layout in layouts:
        tp, pp, zero = layout.split(",")
        code = main([
            "train", "--config", MICRO, "train.precision=bf16", "train.max_steps=3",
            f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.zero_stage={zero}",
            f"run.output_dir={out}/{tp}-{pp}-{zero}", f"run.cache_dir={cache}", "data.num_workers=0",
        ])  # fmt: skip
        if code != 0:
            sys.exit(code)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3:])
