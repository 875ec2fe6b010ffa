"""`belief-lm import-hf DIR --config RUN.yaml`: a Hugging Face Llama (or Qwen3) as a run's
step 0.

Reads a local LlamaForCausalLM or Qwen3ForCausalLM folder (config.json and
model.safetensors, or shards named by model.safetensors.index.json: safetensors only, a
format of raw tensors that runs no code when read; a folder with pickled weights alone,
`pytorch_model*.bin`, is refused, as loading one can run any code it holds) and writes
`<run.output_dir>/checkpoints/step_000000`, a weights-only checkpoint
(belief_lm/checkpoint/files.py): `belief-lm train` with the same config starts from those
weights (checkpoint.resume=auto finds it, or name it), at any layout, with a fresh
optimizer and data stream; evaluate, generate and export read it too.

Checked before any work, each refusal naming the field: the run's model must be a Llama
(RMSNorm, SwiGLU, RoPE, no biases) of the checkpoint's shape (layers, width, heads, KV
heads, MLP width, vocabulary, RoPE theta, norm epsilon, tied embeddings). A Qwen3 is a
Llama with QK-norm (q_norm / k_norm per head, before RoPE): the run needs model.qk_norm,
and a head_dim of hidden_size / num_attention_heads; no sliding window. The tokenizer:
a Llama's ids come from its own tokenizer, not from one belief-lm would train, so the run
must name it (data.tokenizer.path), or DIR must hold its sentencepiece `tokenizer.model`,
which the written config then names (give `train` the same data.tokenizer.path).

Weights are fp32 under BeliefLM's names (the model's description, belief_lm.description,
read the other way than export/hf.py reads it). Any attention
variant may be chosen: softmax computes what the Llama computes; the others start from its
weights (belief_star's W^s, which a Llama lacks, is initialised as a fresh model's, from
run.seed; so are the QK-norms of a run with model.qk_norm from a Llama).
"""

from __future__ import annotations

import json
from pathlib import Path

from belief_lm.checkpoint.files import CheckpointInfo, complete_checkpoints, step_name
from belief_lm.config import Config, ModelConfig, padded_vocab_size
from belief_lm.description import describe
from belief_lm.errors import BadInput
from belief_lm.preflight import checkpoint_root
from data_pipeline.tokenizer import Tokenizer

LLAMA_ARCHITECTURE = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding": "rope",
    "bias": False,
}
"""ModelConfig fields a Llama fixes."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""The model types import-hf reads (config.json's model_type) and their classes."""


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
    """config.json of a Llama or Qwen3 checkpoint (transformers 4 and 5 spellings of RoPE's
    settings flattened; `model_type` set), or BadInput naming what is wrong."""
    path = folder / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BadInput(f"{path}: not a readable config.json ({err})") from None
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        classes = hf.get("architectures") or []
        kind = next((k for k, c in ARCHITECTURES.items() if c in classes), None)
    if kind is None:
        raise BadInput(
            f"{path}: model_type {hf.get('model_type')!r} is not a Llama (LlamaForCausalLM) "
            "or a Qwen3 (Qwen3ForCausalLM)"
        )
    hf["model_type"] = kind
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    hf.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    hf["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return hf


def check_model(hf: dict, model: ModelConfig, vocab_size: int, path: Path) -> None:
    """BadInput listing every field where the run's model is not the checkpoint's."""
    differ = [
        f"model.{field} is {getattr(model, field)!r}, a Llama needs {value!r}"
        for field, value in LLAMA_ARCHITECTURE.items()
        if getattr(model, field) != value
    ]
    if hf["model_type"] == "qwen3":
        if not model.qk_norm:
            differ.append("model.qk_norm is False, a Qwen3 needs True (its q_norm, k_norm)")
        if hf.get("use_sliding_window") or any(
            kind != "full_attention" for kind in hf.get("layer_types") or []
        ):
            differ.append("use_sliding_window: belief-lm attends to the whole context")
    for key, default, ours, value in shape_fields(model, vocab_size):
        theirs = hf.get(key, default)
        if theirs is None or theirs != value:
            differ.append(f"{key} is {theirs!r}, {ours} is {value!r}")
    if differ:
        raise BadInput(f"{path / 'config.json'} does not fit the run: " + "; ".join(differ))


def run_tokenizer(cfg: Config, folder: Path) -> tuple[Config, Tokenizer]:
    """The sentencepiece model whose ids the checkpoint was trained on: data.tokenizer.path,
    else DIR/tokenizer.model (then named in the config returned)."""
    if cfg.data.tokenizer.path is None:
        if not (folder / "tokenizer.model").is_file():
            raise BadInput(
                f"data.tokenizer.path is not set and {folder} has no tokenizer.model: a Hugging "
                "Face checkpoint's ids are its own tokenizer's; set data.tokenizer.path to "
                "that sentencepiece model (one trained by belief-lm would not fit the embedding)"
            )
        cfg = cfg.model_copy(deep=True)
        cfg.data.tokenizer.path = str(folder / "tokenizer.model")
    path = Path(cfg.data.tokenizer.path).expanduser()
    if not path.is_file():
        raise BadInput(f"data.tokenizer.path: no such file: {path}")
    return cfg, Tokenizer(path)


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json names (BadInput if
    they are not there, naming pickled weights it refuses to read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise BadInput(f"{index}: not a safetensors index ({err!r})") from None
        if not all(isinstance(s, str) and s == Path(s).name for s in shards):
            raise BadInput(f"{index}: its weight_map names files outside {folder}")
        files = [folder / shard for shard in shards]
    else:
        files = [folder / "model.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        why = (
            f"; {', '.join(pickled)} is pickled weights, which can run code when loaded: "
            "not read (convert them to safetensors where you trust them, e.g. transformers' "
            "save_pretrained(safe_serialization=True))"
            if pickled
            else " (safetensors only)"
        )
        raise BadInput(f"no weights: {', '.join(missing)} not found{why}")
    return files


def import_hf(folder: str | Path, cfg: Config) -> Path:
    """Write the step-0 checkpoint of run `cfg` from Llama checkpoint `folder`; returns its
    path. BadInput (nothing written) if anything does not fit."""
    folder = Path(folder).expanduser()
    hf = read_config(folder)
    cfg, tokenizer = run_tokenizer(cfg, folder)
    vocab_size = padded_vocab_size(tokenizer.vocab_size, cfg.model, 1)
    check_model(hf, cfg.model, vocab_size, folder)
    root = checkpoint_root(cfg)
    if complete_checkpoints(root) or (root / step_name(0)).exists():
        raise BadInput(f"{root} already holds checkpoints: import into a new run.output_dir")
    weights = llama_weights(weight_files(folder), cfg, vocab_size)
    info = CheckpointInfo(0, 0, 1, 1, 1, 0, vocab_size, weights_only=True)
    extra = {"config.yaml": cfg.to_yaml().encode(), "tokenizer.model": tokenizer.path.read_bytes()}
    from belief_lm.checkpoint.store import save_weights

    return save_weights(root, info, weights, extra)


def llama_weights(files: list[Path], cfg: Config, vocab_size: int) -> dict:
    """BeliefLM's whole fp32 weights from the Llama's tensors, joined as the model's
    description says; what a Llama lacks (belief_star's W^s) as a fresh model of run.seed
    initialises it."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from belief_lm.export.hf import from_hf_state_dict

    theirs: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            theirs.update(load_file(file))
        except (OSError, SafetensorError) as err:  # a corrupt or cut-short file
            raise BadInput(f"{file}: not a readable safetensors file ({err})") from None
    description = describe(cfg.model, vocab_size)
    converted = from_hf_state_dict(theirs, description)  # every name and shape checked
    weights = description.weights()
    missing = [w.name for w in weights if w.in_llama and w.name not in converted]
    if missing:
        raise BadInput(
            f"the checkpoint's tensors do not fit the run: missing {', '.join(missing[:5])}"
        )
    fresh = {}
    if len(converted) < len(weights):
        from belief_lm.model.gpt import BeliefLM
        from belief_lm.parallel.grid import ProcessGrid

        ProcessGrid.single_process()
        causal = cfg.model.model_copy(update={"attention_mask": "causal"})  # the same weights
        fresh = BeliefLM(causal, vocab_size, seed=cfg.run.seed).state_dict()
    return {w.name: converted.get(w.name, fresh.get(w.name)).float().contiguous() for w in weights}
