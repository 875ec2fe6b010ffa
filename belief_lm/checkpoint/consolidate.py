"""A checkpoint as one model: its config, whole fp32 weights under BeliefLM's parameter
names, and its tokenizer, whatever layout saved it. What evaluation, generation and
export start from.

- one shard (TP=1, PP=1) without ZeRO-3: the weights in DeepSpeed's model-state file;
- ZeRO 1/2 on any layout: the universal form (belief_lm/checkpoint/universal.py), which
  merges TP slices and ZeRO fragments into whole fp32 tensors (converted once, kept next
  to the checkpoint as <step>-universal);
- ZeRO-3 at TP=1, PP=1: DeepSpeed's zero_to_fp32 consolidation.
Other combinations (ZeRO-0 with TP/PP > 1, ZeRO-3 with TP > 1) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from belief_lm.checkpoint.files import CheckpointError, CheckpointInfo, read_info
from belief_lm.checkpoint.universal import ensure_universal
from belief_lm.config import Config
from belief_lm.model.gpt import BeliefLM


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
        """BeliefLM at TP=1 with these weights (eval mode, fp32, CPU)."""
        if tensor_parallel != 1:
            raise ValueError("build_model builds a single-process (TP=1) model")
        model = BeliefLM(self.config.model, self.info.vocab_size, seed=self.config.run.seed)
        load_full_state(model, self.state_dict)
        return model.eval()


def load_full_state(model: BeliefLM, state: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into `model` (sharded to this rank's slice under tensor
    parallelism); every parameter must be present with the right full shape."""
    from belief_lm.parallel.gather import shard_tensor_parallel

    missing = [n for n, _ in model.named_parameters() if n not in state]
    if missing:
        raise CheckpointError(f"the checkpoint has no weights for {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_tensor_parallel(state[name].to(param.dtype), param))


def consolidate(path: str | Path) -> Consolidated:
    """Read checkpoint `path` (a step directory) as a Consolidated model."""
    path = Path(path).expanduser()
    info = read_info(path)
    try:
        config = Config.model_validate(yaml.safe_load((path / "config.yaml").read_text()))
    except (OSError, yaml.YAMLError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: unusable config.yaml ({err})") from None
    tokenizer = path / "tokenizer.model"
    if not tokenizer.is_file():
        raise CheckpointError(f"checkpoint {path} has no tokenizer.model")
    return Consolidated(path, info, config, _weights(path, info, config), tokenizer)


def _weights(path: Path, info: CheckpointInfo, config: Config) -> dict[str, torch.Tensor]:
    single = info.tensor == 1 and info.pipeline == 1
    if single and info.zero_stage < 3:
        weights = path / "mp_rank_00_model_states.pt"
        if not weights.is_file():
            raise CheckpointError(f"checkpoint {path} has no {weights.name}")
        state = torch.load(weights, map_location="cpu", weights_only=False)
        return {k: v.float() for k, v in state["module"].items() if not k.endswith("_extra_state")}
    if info.zero_stage in (1, 2):
        universal = ensure_universal(path, config.model)
        names = [n for n, _ in _meta_model(config, info).named_parameters()]
        return {
            name: torch.load(universal / "zero" / name / "fp32.pt", weights_only=False)["param"]
            for name in names
        }
    if single and info.zero_stage == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
        return {k: v.float() for k, v in state.items()}
    raise CheckpointError(
        f"checkpoint {path} (ZeRO {info.zero_stage}, TP{info.tensor} x PP{info.pipeline}) "
        "cannot be consolidated: DeepSpeed merges TP/PP shards only for ZeRO 1/2 checkpoints"
    )


def _meta_model(config: Config, info: CheckpointInfo) -> BeliefLM:
    with torch.device("meta"):
        return BeliefLM(config.model, info.vocab_size)
