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
layout: the fused QKV is grouped per KV group as [q heads of the group..., k, v], and a
SwiGLU fc1 holds [gate; up]. The names are Llama's (transformers' LlamaForCausalLM), so
`from_hf_state_dict`, the way back, also reads a Llama checkpoint (belief_lm/hf_import.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from belief_lm import attention, variants
from belief_lm.checkpoint.consolidate import Consolidated
from belief_lm.config import ModelConfig
from data_pipeline.tokenizer import Tokenizer

TEMPLATE = Path(__file__).with_name("hf_template")
SHIPPED_CODE = {
    "configuration_belief_lm.py": TEMPLATE / "configuration_belief_lm.py",
    "modeling_belief_lm.py": TEMPLATE / "modeling_belief_lm.py",
    "tokenization_belief_lm.py": TEMPLATE / "tokenization_belief_lm.py",
    "belief_attention.py": Path(attention.__file__),
    "variants.py": Path(variants.__file__),
}

# megatron module (under the model / under a layer) -> transformers module; QKV and a
# SwiGLU fc1 are split instead (see hf_state_dict)
TOP_LEVEL = {
    "embedding.word_embeddings": "model.embed_tokens",
    "embedding.position_embeddings": "model.embed_positions",
    "final_norm": "model.norm",
    "output_layer": "lm_head",
}
IN_LAYER = {
    "input_layernorm": "input_layernorm",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "self_attention.linear_proj": "self_attn.o_proj",
    "self_attention.linear_proj.w_s": "self_attn.s_proj",
    "mlp.linear_fc1": "mlp.up_proj",
    "mlp.linear_fc2": "mlp.down_proj",
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


def split_qkv(fused: Tensor, heads: int, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """megatron's fused QKV weight or bias (rows grouped per KV group as [q of the group's
    heads..., k, v]) as separate q [heads*d], k [groups*d], v [groups*d] rows."""
    head_dim = fused.shape[0] // (heads + 2 * groups)
    per_group = heads // groups
    grouped = fused.reshape(groups, (per_group + 2) * head_dim, *fused.shape[1:])
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return tuple(x.reshape(-1, *fused.shape[1:]) for x in (q, k, v))


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, groups: int) -> Tensor:
    """megatron's fused QKV weight or bias from separate q, k, v rows (split_qkv's inverse)."""
    rest = q.shape[1:]
    grouped = [x.reshape(groups, -1, *rest) for x in (q, k, v)]
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def hf_state_dict(state: dict[str, Tensor], model: ModelConfig) -> dict[str, Tensor]:
    """BeliefLM's whole tensors under the shipped model's names (contiguous copies)."""
    heads, groups = model.num_attention_heads, model.query_groups
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        module, leaf = name.rsplit(".", 1)
        layer = re.fullmatch(r"layers\.(\d+)\.(.+)", module)
        if layer is None:
            out[f"{_rename(TOP_LEVEL, module, name)}.{leaf}"] = tensor
            continue
        prefix, module = f"model.layers.{layer[1]}.", layer[2]
        if module == "self_attention.linear_qkv":
            for proj, part in zip("qkv", split_qkv(tensor, heads, groups), strict=True):
                out[f"{prefix}self_attn.{proj}_proj.{leaf}"] = part
        elif module == "mlp.linear_fc1" and model.activation == "swiglu":
            gate, up = tensor.chunk(2, dim=0)
            out[f"{prefix}mlp.gate_proj.{leaf}"], out[f"{prefix}mlp.up_proj.{leaf}"] = gate, up
        else:
            out[f"{prefix}{_rename(IN_LAYER, module, name)}.{leaf}"] = tensor
    return {k: v.contiguous().clone() for k, v in out.items()}


def from_hf_state_dict(state: dict[str, Tensor], model: ModelConfig) -> dict[str, Tensor]:
    """Tensors under transformers' names (ours, or a Llama's) under BeliefLM's, q/k/v fused
    and a SwiGLU's gate and up joined (hf_state_dict's inverse). ValueError naming a tensor
    that has no place in BeliefLM."""
    heads, groups = model.num_attention_heads, model.query_groups
    top, in_layer = _inverse(TOP_LEVEL), _inverse(IN_LAYER)
    if model.activation == "swiglu":
        del in_layer["mlp.up_proj"]  # joined with gate_proj into fc1 below
    out: dict[str, Tensor] = {}
    joined: dict[str, dict[str, Tensor]] = {}  # fused BeliefLM name -> its parts
    for name, tensor in state.items():
        module, leaf = name.rsplit(".", 1)
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
        if layer is None:
            out[f"{_rename(top, module, name)}.{leaf}"] = tensor
            continue
        prefix, module = f"layers.{layer[1]}.", layer[2]
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            joined.setdefault(f"{prefix}self_attention.linear_qkv.{leaf}", {})[module[-6]] = tensor
        elif module in ("mlp.gate_proj", "mlp.up_proj") and model.activation == "swiglu":
            joined.setdefault(f"{prefix}mlp.linear_fc1.{leaf}", {})[module[4:-5]] = tensor
        else:
            out[f"{prefix}{_rename(in_layer, module, name)}.{leaf}"] = tensor
    for name, parts in joined.items():
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias")) and len(parts) == 3:
            out[name] = fuse_qkv(parts["q"], parts["k"], parts["v"], heads, groups)
        elif set(parts) == {"gate", "up"}:
            out[name] = torch.cat((parts["gate"], parts["up"]))
        else:
            raise ValueError(f"{name} is incomplete: only {', '.join(sorted(parts))} given")
    return out


def _inverse(table: dict[str, str]) -> dict[str, str]:
    return {theirs: ours for ours, theirs in table.items()}


def _rename(table: dict[str, str], module: str, name: str) -> str:
    if module not in table:
        raise ValueError(f"no counterpart for tensor {name}")
    return table[module]


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
    weights = hf_state_dict(checkpoint.state_dict, model)
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
