"""`belief-lm import-hf DIR --config RUN.yaml`: a Hugging Face Llama as a run's step 0.

Reads a local LlamaForCausalLM folder (config.json and model.safetensors, or shards named
by model.safetensors.index.json) and writes `<run.output_dir>/checkpoints/step_000000`, a
weights-only checkpoint (belief_lm/checkpoint/files.py): `belief-lm train` with the same
config starts from those weights (checkpoint.resume=auto finds it, or name it), at any
layout, with a fresh optimizer and data stream; evaluate, generate and export read it too.

Checked before any work, each refusal naming the field: the run's model must be a Llama
(RMSNorm, SwiGLU, RoPE, no biases) of the checkpoint's shape (layers, width, heads, KV
heads, MLP width, vocabulary, RoPE theta, norm epsilon, tied embeddings). The tokenizer:
a Llama's ids come from its own tokenizer, not from one belief-lm would train, so the run
must name it (data.tokenizer.path), or DIR must hold its sentencepiece `tokenizer.model`,
which the written config then names (give `train` the same data.tokenizer.path).

Weights are fp32 under BeliefLM's names (export/hf.py's naming, in reverse). Any attention
variant may be chosen: softmax computes what the Llama computes; the others start from its
weights (belief_star's W^s, which a Llama lacks, is initialised as a fresh model's, from
run.seed).
"""

from __future__ import annotations

import json
from pathlib import Path

from belief_lm.checkpoint.files import CheckpointInfo, complete_checkpoints, step_name
from belief_lm.config import Config, ModelConfig, padded_vocab_size
from belief_lm.preflight import checkpoint_root
from data_pipeline.tokenizer import Tokenizer

LLAMA_ARCHITECTURE = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding": "rope",
    "bias": False,
}
"""ModelConfig fields a Llama fixes."""


def shape_fields(model: ModelConfig, vocab_size: int) -> list[tuple[str, object, str, object]]:
    """(config.json key, its default, the run's field, the run's value) that must agree."""
    return [
        ("num_hidden_layers", None, "model.num_layers", model.num_layers),
        ("hidden_size", None, "model.hidden_size", model.hidden_size),
        ("num_attention_heads", None, "model.num_attention_heads", model.num_attention_heads),
        ("num_key_value_heads", None, "model.num_query_groups", model.query_groups),
        ("intermediate_size", None, "model.ffn_hidden_size", model.ffn_size),
        ("vocab_size", None, "the run's vocabulary (model.vocab_size)", vocab_size),
        ("rope_theta", 10000.0, "model.rotary_base", model.rotary_base),
        ("rms_norm_eps", 1e-6, "model.norm_epsilon", model.norm_epsilon),
        ("tie_word_embeddings", False, "model.tie_embeddings", model.tie_embeddings),
        ("head_dim", model.head_dim, "model.hidden_size / num_attention_heads", model.head_dim),
        ("hidden_act", "silu", "model.activation (swiglu)", "silu"),
        ("attention_bias", False, "model.bias", False),
        ("mlp_bias", False, "model.bias", False),
        ("rope_type", "default", "RoPE without scaling", "default"),
    ]


def read_config(folder: Path) -> dict:
    """config.json of a Llama checkpoint (transformers 4 and 5 spellings of RoPE's settings
    flattened), or ValueError naming what is wrong."""
    path = folder / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable config.json ({err})") from None
    if hf.get("model_type") != "llama" and "LlamaForCausalLM" not in hf.get("architectures", []):
        raise ValueError(
            f"{path}: model_type {hf.get('model_type')!r} is not a Llama (LlamaForCausalLM)"
        )
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    hf.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    hf["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return hf


def check_model(hf: dict, model: ModelConfig, vocab_size: int, path: Path) -> None:
    """ValueError listing every field where the run's model is not the checkpoint's."""
    differ = [
        f"model.{field} is {getattr(model, field)!r}, a Llama needs {value!r}"
        for field, value in LLAMA_ARCHITECTURE.items()
        if getattr(model, field) != value
    ]
    for key, default, ours, value in shape_fields(model, vocab_size):
        theirs = hf.get(key, default)
        if theirs is None or theirs != value:
            differ.append(f"{key} is {theirs!r}, {ours} is {value!r}")
    if differ:
        raise ValueError(f"{path / 'config.json'} does not fit the run: " + "; ".join(differ))


def run_tokenizer(cfg: Config, folder: Path) -> tuple[Config, Tokenizer]:
    """The sentencepiece model whose ids the checkpoint was trained on: data.tokenizer.path,
    else DIR/tokenizer.model (then named in the config returned)."""
    if cfg.data.tokenizer.path is None:
        if not (folder / "tokenizer.model").is_file():
            raise ValueError(
                f"data.tokenizer.path is not set and {folder} has no tokenizer.model: a Hugging "
                "Face checkpoint's ids are its own tokenizer's; set data.tokenizer.path to "
                "that sentencepiece model (one trained by belief-lm would not fit the embedding)"
            )
        cfg = cfg.model_copy(deep=True)
        cfg.data.tokenizer.path = str(folder / "tokenizer.model")
    path = Path(cfg.data.tokenizer.path).expanduser()
    if not path.is_file():
        raise ValueError(f"data.tokenizer.path: no such file: {path}")
    return cfg, Tokenizer(path)


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / shard for shard in shards]
    else:
        files = [folder / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"no weights: {', '.join(missing)} not found (safetensors only)")
    return files


def import_hf(folder: str | Path, cfg: Config) -> Path:
    """Write the step-0 checkpoint of run `cfg` from Llama checkpoint `folder`; returns its
    path. ValueError (nothing written) if anything does not fit."""
    folder = Path(folder).expanduser()
    hf = read_config(folder)
    cfg, tokenizer = run_tokenizer(cfg, folder)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg.model, 1)
    check_model(hf, cfg.model, vocab_size, folder)
    root = checkpoint_root(cfg)
    if complete_checkpoints(root) or (root / step_name(0)).exists():
        raise ValueError(f"{root} already holds checkpoints: import into a new run.output_dir")
    weights = llama_weights(weight_files(folder), cfg, vocab_size)
    info = CheckpointInfo(0, 0, 1, 1, 1, 0, vocab_size, weights_only=True)
    extra = {"config.yaml": cfg.to_yaml().encode(), "tokenizer.model": tokenizer.path.read_bytes()}
    from belief_lm.checkpoint.store import save_weights

    return save_weights(root, info, weights, extra)


def llama_weights(files: list[Path], cfg: Config, vocab_size: int) -> dict:
    """BeliefLM's whole fp32 weights from the Llama's tensors; what a Llama lacks
    (belief_star's W^s) as a fresh model of run.seed initialises it."""
    import torch
    from safetensors.torch import load_file

    from belief_lm.export.hf import from_hf_state_dict
    from belief_lm.model.gpt import BeliefLM
    from belief_lm.parallel.grid import ProcessGrid

    theirs: dict[str, torch.Tensor] = {}
    for file in files:
        theirs.update(load_file(file))
    converted = from_hf_state_dict(theirs, cfg.model)
    ProcessGrid.single_process()
    fresh = BeliefLM(cfg.model, vocab_size, seed=cfg.run.seed).state_dict()
    fresh = {name: t for name, t in fresh.items() if not name.endswith("_extra_state")}
    unknown = sorted(set(converted) - set(fresh))
    lacking = sorted(n for n in set(fresh) - set(converted) if not n.endswith("w_s.weight"))
    problems = [f"{what} {', '.join(names[:5])}" for what, names in
                (("unexpected", unknown), ("missing", lacking)) if names]  # fmt: skip
    if problems:
        raise ValueError("the checkpoint's tensors do not fit the run: " + "; ".join(problems))
    for name, tensor in converted.items():
        if tensor.shape != fresh[name].shape:
            raise ValueError(
                f"tensor {name}: shape {tuple(tensor.shape)}, the run's model has "
                f"{tuple(fresh[name].shape)}"
            )
    return {name: converted.get(name, t).float().contiguous() for name, t in fresh.items()}
