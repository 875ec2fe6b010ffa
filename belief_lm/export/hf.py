"""Export a checkpoint as a Hugging Face transformers model folder.

    OUT/config.json                 BeliefLMConfig, with auto_map to the shipped code
    OUT/generation_config.json      EOS/BOS/PAD ids; use_cache (decoding with a cache)
    OUT/model.safetensors           fp32 weights under transformers-style names
    OUT/configuration_belief_lm.py  \
    OUT/modeling_belief_lm.py        > the model in plain PyTorch (hf_template/)
    OUT/belief_attention.py         |  (a copy of belief_lm/attention.py: the variants' math)
    OUT/variants.py                /  (belief_lm/variants.py: the variants by name)
    OUT/tokenization_belief_lm.py, tokenizer.model, tokenizer_config.json

Loads with AutoModelForCausalLM / AutoTokenizer .from_pretrained(OUT, trust_remote_code=True)
and needs neither belief-lm nor megatron. Weights are renamed and split from megatron's
layout as the model's description (belief_lm.description) names them: the fused QKV is
grouped per KV group as [q heads of the group..., k, v], and a SwiGLU fc1 holds [gate;
up]. The names are Llama's (transformers' LlamaForCausalLM), so `from_hf_state_dict`, the
way back through the same table, also reads a Llama checkpoint (belief_lm/hf_import.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from belief_lm import attention, variants
from belief_lm.checkpoint.consolidate import Consolidated
from belief_lm.config import ModelConfig
from belief_lm.description import ModelDescription, describe
from belief_lm.errors import BadInput
from data_pipeline.tokenizer import Tokenizer

TEMPLATE = Path(__file__).with_name("hf_template")
SHIPPED_CODE = {
    "configuration_belief_lm.py": TEMPLATE / "configuration_belief_lm.py",
    "modeling_belief_lm.py": TEMPLATE / "modeling_belief_lm.py",
    "tokenization_belief_lm.py": TEMPLATE / "tokenization_belief_lm.py",
    "belief_attention.py": Path(attention.__file__),
    "variants.py": Path(variants.__file__),
}


def hf_config(model: ModelConfig, vocab_size: int, tokenizer: Tokenizer) -> dict:
    """config.json for `model` (BeliefLMConfig's fields, auto_map to the shipped code)."""
    return {
        "architectures": ["BeliefLMForCausalLM"],
        "model_type": "belief_lm",
        "auto_map": {
            "AutoConfig": "configuration_belief_lm.BeliefLMConfig",
            "AutoModelForCausalLM": "modeling_belief_lm.BeliefLMForCausalLM",
        },
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.query_groups,
        "intermediate_size": model.ffn_size,
        "max_position_embeddings": model.seq_length,
        "normalization": model.normalization,
        "norm_epsilon": model.norm_epsilon,
        "qk_norm": model.qk_norm,
        "activation": model.activation,
        "position_embedding": model.position_embedding,
        "rotary_base": model.rotary_base,
        "bias": model.bias,
        "attention": model.attention,
        "gamma": model.gamma,
        "beta": model.beta,
        "head_scales": model.head_scales,
        "tie_word_embeddings": model.tie_embeddings,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
    }


def split_rows(fused: Tensor, rows: list[int], groups: int) -> list[Tensor]:
    """The parts of a weight or bias whose rows (dim 0) hold them grouped: `groups` groups,
    each with its share of every part's rows in turn (megatron's QKV: per KV group, [q of
    the group's heads..., k, v]; one group: the parts one after the other). `rows`: each
    part's rows in all."""
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, -1, *rest)
    parts = grouped.split([count // groups for count in rows], dim=1)
    return [part.reshape(-1, *rest) for part in parts]


def join_rows(parts: list[Tensor], groups: int) -> Tensor:
    """The weight or bias whose rows hold `parts` in `groups` groups (split_rows' inverse)."""
    rest = parts[0].shape[1:]
    grouped = [part.reshape(groups, -1, *rest) for part in parts]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def hf_state_dict(state: dict[str, Tensor], description: ModelDescription) -> dict[str, Tensor]:
    """BeliefLM's whole tensors under the shipped model's names (contiguous copies), split
    and renamed as `description` says. ValueError naming a tensor the description lacks,
    or a weight `state` lacks."""
    described = description.weights()
    unknown = sorted(set(state) - {weight.name for weight in described})
    if unknown:
        raise ValueError(f"no counterpart for tensor {', '.join(unknown[:5])}")
    out: dict[str, Tensor] = {}
    for weight in described:
        if weight.name not in state:
            raise ValueError(f"no tensor for weight {weight.name}")
        rows = [part.rows for part in weight.hf]
        pieces = split_rows(state[weight.name], rows, weight.hf_groups)
        for part, piece in zip(weight.hf, pieces, strict=True):
            out[part.name] = piece.contiguous().clone()
    return out


def from_hf_state_dict(
    state: dict[str, Tensor], description: ModelDescription
) -> dict[str, Tensor]:
    """Tensors under transformers' names (ours, or a Llama's) under BeliefLM's, joined as
    `description` says (hf_state_dict's inverse). A weight none of whose tensors is given
    is left out (a Llama has no W^s: the caller decides). BadInput naming a tensor that
    has no place in the model, one of the wrong shape, or a weight only partly given."""
    given = dict(state)
    out: dict[str, Tensor] = {}
    for weight in description.weights():
        found = [part.name for part in weight.hf if part.name in given]
        if not found:
            continue
        if len(found) < len(weight.hf):
            raise BadInput(f"{weight.name} is incomplete: only {', '.join(found)} given")
        parts = [given.pop(part.name) for part in weight.hf]
        for part, tensor in zip(weight.hf, parts, strict=True):
            if tuple(tensor.shape) != weight.hf_shape(part):
                raise BadInput(
                    f"tensor {part.name}: shape {tuple(tensor.shape)}, the run's model has "
                    f"{weight.hf_shape(part)}"
                )
        out[weight.name] = join_rows(parts, weight.hf_groups)
    if given:
        raise BadInput(
            f"no counterpart in the run's model for tensor {', '.join(sorted(given)[:5])}"
        )
    return out


def export_hf(checkpoint: Consolidated, output: Path) -> None:
    """Write the transformers folder for `checkpoint` into `output` (an empty directory)."""
    model, tokenizer = checkpoint.config.model, Tokenizer(checkpoint.tokenizer_path)
    config = hf_config(model, checkpoint.info.vocab_size, tokenizer)
    _write_json(output / "config.json", config)
    # the embedding is padded past the tokenizer's vocabulary: never generate those ids
    padding = list(range(tokenizer.vocab_size, checkpoint.info.vocab_size))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    generation["use_cache"] = True
    if padding:
        generation["suppress_tokens"] = padding
    _write_json(output / "generation_config.json", generation)
    description = describe(model, checkpoint.info.vocab_size)
    weights = hf_state_dict(checkpoint.state_dict, description)
    save_file(weights, output / "model.safetensors", metadata={"format": "pt"})
    for name, source in SHIPPED_CODE.items():
        shutil.copyfile(source, output / name)
    shutil.copyfile(tokenizer.path, output / "tokenizer.model")
    _write_json(output / "tokenizer_config.json", {
        "tokenizer_class": "BeliefLMTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_belief_lm.BeliefLMTokenizer", None]},
    })  # fmt: skip


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
