"""The model described once, without torch: every weight of a BeliefLM and what a decoder
layer's forward keeps for backward, derived from ModelConfig.

A weight's entry (`Weight`) names it as BeliefLM does (megatron's module path), gives its
whole shape, how tensor parallelism splits it (megatron's partition dim and stride, or
replicated), its Hugging Face name(s) and whether a matmul uses it; `ModelDescription`
lays the entries out over the model's decoder layers and pipeline stages. A layer's kept
tensors (`Saved`) are counted per token on one tensor-parallel rank. Who reads them:

- the megatron build (model/) is held to them by tests/test_description.py: names, shapes
  and splits at TP=1 and TP=2, and pipeline stages, for every preset and variant;
- checkpoint/universal.py derives DeepSpeed's universal_checkpoint_info from the splits,
  checkpoint/consolidate.py joins tensor-parallel slices by them;
- export/hf.py reads the Hugging Face names both ways (the export splits and renames,
  `import-hf` joins); the shipped modeling file (export/hf_template/) is held to them by
  the test;
- plan.py: parameters per pipeline stage and rank, the largest tensor, activations per
  layer; train/flops.py: the matmul weights.

Adding a model option touches this module once: its weights go into `layer_weights` (or
`embedding_weights` / `head_weights`), each with its shape, split and Hugging Face name,
and what its forward keeps into `layer_saved`. QK-norm (model.qk_norm), say, is two
replicated entries of head_dim (`self_attention.q_layernorm.weight`, `k_layernorm`;
Hugging Face `self_attn.q_norm.weight`, `k_norm`) and the two norms' kept tensors;
sequence parallelism changes no weight, only the `Saved` entries outside the
tensor-parallel region (the norms' and the layer input's elements split over TP ranks); a
document mask or z-loss changes neither. Then the option is built in model/ and in the HF
modeling file, and the test holds both to the entries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from belief_lm.config import ModelConfig

LAYER_PREFIX, HF_LAYER_PREFIX = "layers.{}.", "model.layers.{}."
"""Where decoder layer i's weights are, in BeliefLM and in the Hugging Face export."""


class Split(NamedTuple):
    """How tensor parallelism splits a weight over TP ranks (megatron's partition_dim and
    partition_stride): along `dim` into TP x `stride` equal chunks, rank r holding chunks
    r, TP + r, ..., (stride - 1) x TP + r, concatenated."""

    dim: int
    stride: int = 1


COLUMN = Split(0)
"""Column-parallel: rows (output features) over TP ranks; also the vocabulary-parallel
embedding and output layer."""
ROW = Split(1)
"""Row-parallel: columns (input features) over TP ranks; its bias is replicated."""
GATED = Split(0, stride=2)
"""A gated MLP's fc1 [gate; up]: each rank holds [gate_r; up_r]."""


class HFPart(NamedTuple):
    """One Hugging Face tensor of a weight: its name and its rows (dim 0)."""

    name: str
    rows: int


@dataclass(frozen=True)
class Weight:
    """One parameter of BeliefLM."""

    name: str
    """BeliefLM's parameter name; a decoder layer's under `layers.<i>.`."""
    shape: tuple[int, ...]
    """Whole, as at TP=1."""
    split: Split | None
    """How tensor parallelism splits it; None: replicated on every TP rank."""
    hf: tuple[HFPart, ...]
    """Its Hugging Face tensor, or the tensors it joins along dim 0 (q, k, v into the
    fused QKV; gate and up into a SwiGLU fc1); a layer's under `model.layers.<i>.`."""
    hf_groups: int = 1
    """The parts join within each of this many groups of rows: megatron's QKV is grouped
    per KV group, [q of the group's heads..., k, v]; 1: one after the other."""
    matmul: bool = False
    """The weight of a matrix multiply (6 training FLOPs per weight and token): linear
    layers, the output layer or the embedding tied to it."""
    in_llama: bool = True
    """A Llama has it (import-hf takes it from one); False: an option's own (belief_star's
    W^s, the QK-norms), which an import initialises as a fresh model does when its source
    lacks it."""

    def shard_shape(self, tensor: int) -> tuple[int, ...]:
        """Its shape on one of `tensor` TP ranks."""
        if self.split is None:
            return self.shape
        dims = list(self.shape)
        dims[self.split.dim] //= tensor
        return tuple(dims)

    def shard_numel(self, tensor: int) -> int:
        return math.prod(self.shard_shape(tensor))

    def hf_shape(self, part: HFPart) -> tuple[int, ...]:
        """The shape of Hugging Face tensor `part` of this weight."""
        return (part.rows, *self.shape[1:])


@dataclass(frozen=True)
class Saved:
    """A tensor a decoder layer's forward keeps for backward: `elements` per token on one
    tensor-parallel rank (per position of the sequence if `per_position`), in fp32 or in
    the model's dtype."""

    what: str
    elements: int
    fp32: bool = False
    kept_under: tuple[str, ...] = ("none", "selective")
    """The recompute modes (train.activation_checkpointing) that keep it: everything
    outside the attention core is kept unless the whole layer is recomputed; selective
    recomputes what is inside the core and keeps its output; full keeps the layer's
    input alone."""
    sequence_split: bool = False
    """Outside the tensor-parallel region (the layer's input, the norms' tensors, the
    residual sums): with sequence parallelism each rank keeps 1/TP of the sequence's
    (Korthikanti et al.'s 10 of 34 units), else the whole sequence's."""
    per_position: bool = False
    """One for each position of the sequence, shared by the micro-batch's rows (RoPE's cos
    and sin, [s, 1, 1, d]): per token 1/micro_batch of `elements`."""

    def bytes(self, bf16: bool) -> int:
        return self.elements * (4 if self.fp32 or not bf16 else 2)


IN_CORE, CORE_OUTPUT, LAYER_INPUT = ("none",), ("selective",), ("full",)
"""Saved.kept_under of the attention core's own tensors, of the output the core returns
(among the core's own without recompute) and of the layer's input (among the first norm's
without full recompute)."""


def embedding_weights(model: ModelConfig, vocab_size: int) -> tuple[Weight, ...]:
    """The first stage's: the vocabulary-parallel token embedding (the output layer's
    weight too when tied) and learned positions."""
    hidden = model.hidden_size
    weights = [
        Weight("embedding.word_embeddings.weight", (vocab_size, hidden), COLUMN,
               (HFPart("model.embed_tokens.weight", vocab_size),), matmul=model.tie_embeddings),
    ]  # fmt: skip
    if model.position_embedding == "learned_absolute":
        rows = model.seq_length
        part = HFPart("model.embed_positions.weight", rows)
        weights.append(
            Weight("embedding.position_embeddings.weight", (rows, hidden), None, (part,))
        )
    return tuple(weights)


def layer_weights(model: ModelConfig) -> tuple[Weight, ...]:
    """One decoder layer's, named within it: the two norms, attention's QKV (column-parallel
    over KV groups), the QK-norms (model.qk_norm; replicated) and output projection W^o
    (row-parallel; belief_star's W^s beside it), the MLP's fc1 (column-parallel; SwiGLU's
    [gate; up] by stride 2) and fc2 (row-parallel); biases follow their matmul's rows, a
    row-parallel one replicated."""
    hidden, ffn, head_dim = model.hidden_size, model.ffn_size, model.head_dim
    heads, groups = model.num_attention_heads, model.query_groups
    q, kv = heads * head_dim, groups * head_dim
    qkv = (HFPart("self_attn.q_proj", q), HFPart("self_attn.k_proj", kv),
           HFPart("self_attn.v_proj", kv))  # fmt: skip
    swiglu = model.activation == "swiglu"
    fc1 = (HFPart("mlp.gate_proj", ffn), HFPart("mlp.up_proj", ffn)) if swiglu else (
        HFPart("mlp.up_proj", ffn),)  # fmt: skip
    weights = [
        *norm_weights(model, "input_layernorm", "input_layernorm"),
        *linear(model, "self_attention.linear_qkv", qkv, hidden, COLUMN, hf_groups=groups),
        *linear(model, "self_attention.linear_proj", (HFPart("self_attn.o_proj", hidden),), q,
                ROW),
    ]  # fmt: skip
    if model.qk_norm:  # one weight of head_dim each, every head's (so every TP rank's)
        weights += [
            Weight(f"self_attention.{ours}.weight", (head_dim,), None,
                   (HFPart(f"self_attn.{theirs}.weight", head_dim),), in_llama=False)
            for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))
        ]  # fmt: skip
    if model.variant.extra_projection:  # W^s: no bias, sharded as W^o
        part = HFPart("self_attn.s_proj.weight", hidden)
        weights.append(Weight("self_attention.linear_proj.w_s.weight", (hidden, q), ROW, (part,),
                              matmul=True, in_llama=False))  # fmt: skip
    weights += [
        *norm_weights(model, "pre_mlp_layernorm", "post_attention_layernorm"),
        *linear(model, "mlp.linear_fc1", fc1, hidden, GATED if swiglu else COLUMN),
        *linear(model, "mlp.linear_fc2", (HFPart("mlp.down_proj", hidden),), ffn, ROW),
    ]
    return tuple(weights)


def head_weights(model: ModelConfig, vocab_size: int) -> tuple[Weight, ...]:
    """The last stage's: the final norm and, untied, the vocabulary-parallel output layer."""
    weights = list(norm_weights(model, "final_norm", "model.norm"))
    if not model.tie_embeddings:
        part = HFPart("lm_head.weight", vocab_size)
        weights.append(Weight("output_layer.weight", (vocab_size, model.hidden_size), COLUMN,
                              (part,), matmul=True))  # fmt: skip
    return tuple(weights)


def norm_weights(model: ModelConfig, name: str, hf_name: str) -> tuple[Weight, ...]:
    """A norm's weight (and LayerNorm's bias): replicated."""
    leaves = ("weight", "bias") if model.normalization == "LayerNorm" else ("weight",)
    hidden = model.hidden_size
    return tuple(
        Weight(f"{name}.{leaf}", (hidden,), None, (HFPart(f"{hf_name}.{leaf}", hidden),))
        for leaf in leaves
    )


def linear(
    model: ModelConfig,
    name: str,
    hf: tuple[HFPart, ...],
    inputs: int,
    split: Split,
    hf_groups: int = 1,
) -> tuple[Weight, ...]:
    """A linear layer's weight [outputs, inputs] and, with model.bias, its bias (replicated
    under a row-parallel split); `hf` are its Hugging Face modules and their rows."""
    outputs = sum(part.rows for part in hf)
    weight = Weight(
        f"{name}.weight",
        (outputs, inputs),
        split,
        tuple(HFPart(f"{p.name}.weight", p.rows) for p in hf),
        hf_groups,
        matmul=True,
    )
    if not model.bias:
        return (weight,)
    bias_split = None if split == ROW else split
    bias = Weight(f"{name}.bias", (outputs,), bias_split,
                  tuple(HFPart(f"{p.name}.bias", p.rows) for p in hf), hf_groups)  # fmt: skip
    return weight, bias


def stage_layers(num_layers: int, stages: int) -> list[int]:
    """Decoder layers of each pipeline stage, as DeepSpeed's PipelineModule splits them
    (partition_method type:DecoderLayer): as even as possible, the first stages taking
    one more when they do not divide."""
    base, extra = divmod(num_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


@dataclass(frozen=True)
class ModelDescription:
    """Every weight of one model: its first stage's, one decoder layer's (repeated
    num_layers times) and its last stage's."""

    num_layers: int
    tied: bool
    """model.tie_embeddings: the embedding is the output layer's weight too."""
    embedding: tuple[Weight, ...]
    layer: tuple[Weight, ...]
    """Named within the layer (model.layers[i]'s are under LAYER_PREFIX)."""
    head: tuple[Weight, ...]

    def weights(self) -> list[Weight]:
        """Every parameter of BeliefLM under its own name (a tied embedding once)."""
        layers = [self.in_layer(i) for i in range(self.num_layers)]
        return [*self.embedding, *(w for layer in layers for w in layer), *self.head]

    def in_layer(self, index: int) -> list[Weight]:
        """Decoder layer `index`'s weights under their model-wide names."""
        ours, theirs = LAYER_PREFIX.format(index), HF_LAYER_PREFIX.format(index)
        return [
            replace(w, name=ours + w.name,
                    hf=tuple(part._replace(name=theirs + part.name) for part in w.hf))
            for w in self.layer
        ]  # fmt: skip

    def stage_weights(self, stage: int, stages: int) -> list[Weight]:
        """The weights pipeline stage `stage` of `stages` holds (`stage_parts`, the decoder
        layers' under their model-wide names)."""
        first, layers, last = self.stage_parts(stage, stages)
        return [*first, *(w for i in layers for w in self.in_layer(i)), *last]

    def stage_parts(
        self, stage: int, stages: int
    ) -> tuple[tuple[Weight, ...], range, tuple[Weight, ...]]:
        """What pipeline stage `stage` of `stages` holds: the embedding on the first, its
        decoder layers (their indices), the final norm and output layer on the last; with
        tied embeddings and a pipeline the last stage holds its own copy of the embedding
        (DeepSpeed's TiedLayerSpec builds the whole embedding module there)."""
        counts = stage_layers(self.num_layers, stages)
        start = sum(counts[:stage])
        first = self.embedding if stage == 0 else ()
        last = ()
        if stage == stages - 1:
            copy = self.embedding if self.tied and stages > 1 else ()
            last = (*copy, *self.head)
        return first, range(start, start + counts[stage]), last

    def stage_parameters(self, stage: int, tensor: int, stages: int) -> int:
        """Parameters one tensor-parallel rank of pipeline stage `stage` holds."""
        first, layers, last = self.stage_parts(stage, stages)

        def count(weights: tuple[Weight, ...]) -> int:
            return sum(w.shard_numel(tensor) for w in weights)

        return count(first) + len(layers) * count(self.layer) + count(last)

    def rank_parameters(self, tensor: int, stages: int) -> list[int]:
        """Parameters one tensor-parallel rank of each pipeline stage holds."""
        return [self.stage_parameters(stage, tensor, stages) for stage in range(stages)]

    def largest_shard(self, tensor: int) -> int:
        """Elements of the largest parameter on one tensor-parallel rank."""
        return max(w.shard_numel(tensor) for w in (*self.embedding, *self.layer, *self.head))

    def matmul_weights(self) -> int:
        """Weights used in matrix multiplies (embedding lookups and norms excluded), the
        output layer's (or the tied embedding's) once."""
        layers = self.num_layers * matmul_count(self.layer)
        return matmul_count(self.embedding) + layers + matmul_count(self.head)


def matmul_count(weights: tuple[Weight, ...] | list[Weight]) -> int:
    """Elements of the matmul weights among `weights` (whole)."""
    return sum(math.prod(w.shape) for w in weights if w.matmul)


def describe(model: ModelConfig, vocab_size: int) -> ModelDescription:
    """The description of `model` with `vocab_size` embedding rows (made once per model:
    the planner asks for the same one for every candidate)."""
    return _description(model.model_dump_json(), vocab_size)


@functools.lru_cache(maxsize=16)
def _description(model_json: str, vocab_size: int) -> ModelDescription:
    model = ModelConfig.model_validate_json(model_json)
    return ModelDescription(
        model.num_layers, model.tie_embeddings, embedding_weights(model, vocab_size),
        layer_weights(model), head_weights(model, vocab_size),
    )  # fmt: skip


# ----------------------------------------------------------------------- kept for backward


def layer_saved(model: ModelConfig, tensor: int, bf16: bool) -> tuple[Saved, ...]:
    """What one decoder layer keeps for backward, per token on one tensor-parallel rank
    (per position where an entry is per_position: RoPE's cos and sin) (made once per
    model, as `describe`).

    Counted from what autograd saves in this model (megatron's local layer spec with
    FamilyCoreAttention), the whole sequence's: under sequence parallelism the entries
    marked sequence_split are 1/TP of that (plan.layer_activations);
    tests/test_plan.py holds the sum under each recompute mode to the allocator. RMSNorm
    keeps an fp32 copy of its input, its fp32 normalized value and its output (torch's
    composite kernel; LayerNorm only its input and output), so the layer input and the
    residual sum are kept through the norms.
    """
    return _layer_saved(model.model_dump_json(), tensor, bf16)


@functools.lru_cache(maxsize=64)
def _layer_saved(model_json: str, tensor: int, bf16: bool) -> tuple[Saved, ...]:
    model = ModelConfig.model_validate_json(model_json)
    hidden, head_dim = model.hidden_size, model.head_dim
    q = model.num_attention_heads // tensor * head_dim
    kv = model.query_groups // tensor * head_dim
    rms = model.normalization == "RMSNorm"
    ffn = model.ffn_size // tensor
    saved = [
        Saved("the layer's input", hidden, kept_under=LAYER_INPUT, sequence_split=True),
        *norm_saved(model, "input_layernorm"),
        Saved("the QKV projection's output (V is a view of it)", q + 2 * kv),
        *qk_norm_saved(model, tensor, bf16),
    ]
    if model.position_embedding == "rope":
        saved += [Saved("RoPE's rotated Q and K", q + kv), rope_saved(model)]
    output = 2 * q if model.variant.extra_projection else q
    saved += [
        Saved("SDPA's output (flash kernels keep no score matrix)", q, kept_under=IN_CORE),
        *core_saved(model, q, bf16),
        Saved("the attention core's output", output, kept_under=CORE_OUTPUT),
        Saved("SDPA's log-sum-exp per head", model.num_attention_heads // tensor, fp32=True),
        *norm_saved(model, "pre_mlp_layernorm"),
        Saved("the norms' statistics", 2 if rms else 4, fp32=True, sequence_split=True),
    ]
    if model.activation == "swiglu":  # megatron's glu adds glu_linear_offset to up: a copy
        what = "the MLP's: fc1's output [gate; up], SiLU's output, up + offset, the product"
        saved.append(Saved(what, 5 * ffn))
    else:
        saved.append(Saved("the MLP's: fc1's output, GELU's", 2 * ffn))
    return tuple(saved)


def norm_saved(model: ModelConfig, name: str) -> tuple[Saved, ...]:
    """A pre-norm's kept tensors (also the final norm's, on the last stage)."""
    hidden = model.hidden_size
    split = {"sequence_split": True}
    if model.normalization == "RMSNorm":
        return (
            Saved(f"{name}: its input in fp32", hidden, fp32=True, **split),
            Saved(f"{name}: its normalized value in fp32", hidden, fp32=True, **split),
            Saved(f"{name}: its output", hidden, **split),
        )
    return Saved(f"{name}: its input", hidden, **split), Saved(
        f"{name}: its output", hidden, **split
    )


def rope_saved(model: ModelConfig) -> Saved:
    """RoPE's cos and sin: megatron's unfused apply_rotary_pos_emb makes them anew from the
    layer's angles (DecoderLayer computes those per layer) for the queries and again for
    the keys, in the model's dtype, and keeps both for backward: 4 x head_dim, the whole
    sequence's on every tensor-parallel rank (the rotation runs in the tensor-parallel
    region). Per position ([s, 1, 1, d]) with positions 0 .. s-1; per token
    ([s, b, 1, d]) under model.attention_mask=document, each row at its own positions."""
    per_position = model.attention_mask != "document"
    return Saved("RoPE's cos and sin, for Q and for K", 4 * model.head_dim,
                 per_position=per_position)  # fmt: skip


def qk_norm_saved(model: ModelConfig, tensor: int, bf16: bool) -> tuple[Saved, ...]:
    """What the QK-norms (model.qk_norm: torch's composite RMSNorm over each head) keep:
    the normalized queries and keys and a statistic per head in fp32, and their input:
    in bf16 its fp32 copy; in fp32 the input itself, new memory only for the queries of
    grouped-query attention (copied out of the fused QKV, where keys stay a view). Without
    RoPE their output is what attention keeps (with it, RoPE's rotation of it)."""
    if not model.qk_norm:
        return ()
    heads, groups = model.num_attention_heads // tensor, model.query_groups // tensor
    q, kv = heads * model.head_dim, groups * model.head_dim
    saved = [
        Saved("QK-norm: the normalized queries and keys in fp32", q + kv, fp32=True),
        Saved("QK-norm: a statistic per head", heads + groups, fp32=True),
    ]
    if bf16:
        saved.append(Saved("QK-norm: its input in fp32", q + kv, fp32=True))
    elif heads != groups:
        saved.append(Saved("QK-norm: the queries, copied out of the fused QKV", q))
    if model.position_embedding != "rope":
        saved.append(Saved("QK-norm: its output, the queries and keys attention reads", q + kv))
    return tuple(saved)


def core_saved(model: ModelConfig, q: int, bf16: bool) -> tuple[Saved, ...]:
    """What the variant's residual signal keeps inside the attention core, beyond SDPA's
    output (`q`: this rank's query channels); selective recompute drops it."""
    residual = model.variant.residual
    if residual == "belief":  # in bf16 the inner products' fp32 copies of MH and V (twice
        # V: _inner_products and _remove_component each widen it) instead of V
        if bf16:
            return (Saved("the inner products' fp32 MH and V (twice)", 3 * q, True, IN_CORE),
                    Saved("Δ", q, kept_under=IN_CORE))  # fmt: skip
        return (Saved("each head's V and Δ", 2 * q, kept_under=IN_CORE),)
    if residual == "belief_star":  # the same for the global and the per-head projection,
        # and the concatenated [Δ, Δ^s] that W^o and W^s read
        if bf16:
            return (Saved("both projections' fp32 MH and V (twice)", 6 * q, True, IN_CORE),
                    Saved("[Δ, Δ^s]", 2 * q, kept_under=IN_CORE))  # fmt: skip
        return (Saved("each head's V and [Δ, Δ^s]", 3 * q, kept_under=IN_CORE),)
    if residual == "attentionx":
        return (Saved("Φ = γV - H", q, kept_under=IN_CORE),)
    if model.variant.mixing == "bn" and model.position_embedding != "rope":
        # recentred queries are a new tensor where RoPE's are not already one
        return (Saved("the recentred queries", q, kept_under=IN_CORE),)
    return ()
