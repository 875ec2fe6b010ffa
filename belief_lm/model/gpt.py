"""The decoder-only language model, built from megatron-core pieces.

Reads top to bottom: token embedding -> decoder layers (megatron TransformerLayer with the
attention family of `attention_layer.py`) -> final norm -> vocab-parallel output layer ->
vocab-parallel cross entropy (`loss.py`, and the z-loss with train.z_loss; with
train.loss_chunk_tokens the output layer computes it a chunk of tokens at a time, fused
with its GEMM). The three stage types are
also the pipeline stages (DeepSpeed PipelineModule), so every stage seeds its own
initialisation: the initial weights depend only on `run.seed`, not on how the model is
split over ranks. megatron's CPU initialisation draws each full weight and keeps this
rank's shard, so tensor parallelism does not change them either.

Layout convention (megatron's): activations are [seq, batch, hidden]; tokens and labels
are [batch, seq]. With sequence parallelism (parallel.sequence_parallel, megatron's
TransformerConfig.sequence_parallel) the activations between the attention and MLP blocks
are [seq / TP, batch, hidden]: the embedding scatters its output over the tensor-parallel
ranks, the column-parallel linears all-gather their input, the row-parallel ones
reduce-scatter their output, the output layer all-gathers the final norm's. The attention
family's sequence-wide statistics are computed inside the attention block, where every
rank holds the whole sequence, so their math does not change.

Documents (model.attention_mask=document): the embedding marks where documents end (tokens
equal to the tokenizer's EOS) and hands the decoder layers (hidden states, ends), which
they hand on (so a pipeline stage passes the marks to the next, DeepSpeed's boolean last
element); each layer derives the documents (attention.documents) for its RoPE positions
and its core attention, and the final norm drops the marks. Nothing comes from the data
pipeline but the tokens, so every source and pre-tokenized data work alike.

Decoding: `BeliefLM.forward(tokens, cache=model.decode_cache())` feeds tokens that continue
what the cache holds (positions go on from there) and returns their logits; the cache's
math is `belief_lm.attention`'s (`DecodeCache`), as in the Hugging Face export.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor
from torch.profiler import record_function

from belief_lm import compat
from belief_lm.attention import DecodeCache, DecodeStep, LayerCache, documents, rotary_angles
from belief_lm.compat import ColumnGemm, ColumnLinear, RowGemm, RowLinear
from belief_lm.config import ModelConfig
from belief_lm.errors import BadInput
from belief_lm.model.attention_layer import (
    DECODING,
    BeliefStarProjection,
    HeadNorm,
    core_attention_spec,
)
from belief_lm.model.loss import LossTerms, chunked_lm_loss, lm_loss, tensor_parallel_input
from belief_lm.parallel.collectives import sum_sequence_parallel_grads
from belief_lm.runtime import derived_seed


def transformer_config(
    cfg: ModelConfig, tensor_parallel: int = 1, sequence_parallel: bool = False
) -> TransformerConfig:
    """megatron's TransformerConfig for our model config; `sequence_parallel`
    (parallel.sequence_parallel, resolved) counts only at tensor_parallel > 1.

    Fusions that need apex/TransformerEngine stay off (they are CUDA-only and optional);
    megatron's unfused RoPE runs without its passes that change nothing
    (compat.lean_rotary_embedding);
    pipeline_model_parallel_size stays 1 because DeepSpeed owns the pipeline (otherwise
    TransformerLayer offsets layer numbers by the pipeline rank).
    """
    swiglu = cfg.activation == "swiglu"
    sequence_parallel = sequence_parallel and tensor_parallel > 1
    if cfg.position_embedding == "rope":
        compat.lean_rotary_embedding()
    if sequence_parallel:
        compat.megatron_collectives_on_host()
        compat.untracked_dropout_rng()
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.query_groups,
        ffn_hidden_size=cfg.ffn_size,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=cfg.bias,
        hidden_dropout=cfg.dropout,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        tensor_model_parallel_size=tensor_parallel,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def decoder_layer_spec(cfg: ModelConfig, recompute: str = "none") -> ModuleSpec:
    """megatron's local GPT layer spec with our core attention (and W^s for belief_star);
    `recompute` is train.activation_checkpointing (selective: the core attention's)."""
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = HiddenNorm
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = core_attention_spec(
        cfg.attention, cfg.gamma, cfg.beta, cfg.head_scales, fused=cfg.compile == "projections",
        recompute=recompute == "selective",
    )  # fmt: skip
    mlp = spec.submodules.mlp.submodules
    # megatron's linears with torch's GEMM where it communicates nothing (compat.ColumnGemm)
    row, column = (RowLinear, ColumnLinear) if cfg.compile == "layer" else (RowGemm, ColumnGemm)
    attention.linear_proj = mlp.linear_fc2 = row
    attention.linear_qkv = mlp.linear_fc1 = column
    if cfg.variant.extra_projection:
        fused = cfg.fused_output_projection
        attention.linear_proj = ModuleSpec(module=BeliefStarProjection, params={"fused": fused})
    if cfg.qk_norm:  # megatron's own slots (IdentityOp otherwise), applied before RoPE;
        # TransformerConfig.qk_layernorm stays False: it only picks these in megatron's
        # specs and sums their gradients in finalize_model_grads, which HeadNorm does itself
        attention.q_layernorm = attention.k_layernorm = HeadNorm
    return spec


class _SequenceSplitNorm:
    """A hidden-state norm whose weights may be used on a part of the sequence only: under
    sequence parallelism each rank normalizes its own [seq / TP, batch, hidden], so its
    weights' gradients are that part's. They then carry megatron's `sequence_parallel`
    mark, by which sum_sequence_parallel_grads sums them over the tensor-parallel group
    (megatron's finalize_model_grads does it by the same mark)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = sequence_parallel


class RMSNorm(_SequenceSplitNorm, torch.nn.RMSNorm):
    """torch's RMSNorm, sequence-parallel aware (_SequenceSplitNorm)."""


class LayerNorm(_SequenceSplitNorm, torch.nn.LayerNorm):
    """torch's LayerNorm, sequence-parallel aware (_SequenceSplitNorm)."""


def hidden_norm_class(config: TransformerConfig) -> type[torch.nn.Module]:
    """The norm of the hidden states (the layers' two and the final one): LayerNorm or
    RMSNorm as megatron's local spec picks them, built with (hidden_size, eps=...,
    sequence_parallel=config.sequence_parallel)."""
    return RMSNorm if config.normalization == "RMSNorm" else LayerNorm


class HiddenNorm:
    """hidden_norm_class's norm as megatron's layer spec builds a norm, from (config,
    hidden_size, eps): the role of megatron's WrappedTorchNorm, which refuses sequence
    parallelism."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        norm_class = hidden_norm_class(config)
        return norm_class(hidden_size, eps=eps, sequence_parallel=config.sequence_parallel)


@contextlib.contextmanager
def seeded_init(seed: int):
    """Draw initial weights from torch's CPU generator seeded with `seed`, leaving the
    global RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


@functools.lru_cache(maxsize=16)
def rotary_frequencies(seq_len: int, dim: int, base: float, device: torch.device) -> Tensor:
    """RoPE angles of positions 0 .. seq_len-1 in megatron's layout [seq, 1, 1, dim].

    Our own (attention.rotary_angles) because megatron's RotaryEmbedding moves its table to
    CUDA unconditionally; megatron's apply_rotary_pos_emb still applies them.
    """
    return rotary_angles(torch.arange(seq_len, device=device), dim, base)[:, None, None, :]


def document_end_token(model: ModelConfig, eos_id: int | None) -> int | None:
    """The token that ends a document under model.attention_mask=document: the tokenizer's
    EOS, which the data stream appends to every document (None under causal). BadInput
    if there is none."""
    if model.attention_mask == "causal":
        return None
    if eos_id is None or eos_id < 0:
        raise BadInput(
            f"model.attention_mask=document needs the tokenizer's EOS id (got {eos_id}): "
            "documents are told apart by the EOS the data stream appends to each; use a "
            "tokenizer with an EOS piece or model.attention_mask=causal"
        )
    return eos_id


class TokenEmbedding(LanguageModelEmbedding):
    """Stage 0: token ids [batch, seq] -> hidden states [seq, batch, hidden], and under
    model.attention_mask=document where documents end (`eos_id`: the tokenizer's EOS)."""

    def __init__(
        self,
        config: TransformerConfig,
        model: ModelConfig,
        vocab_size: int,
        seed: int,
        eos_id: int | None = None,
    ):
        with seeded_init(seed):
            super().__init__(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=model.seq_length,
                position_embedding_type=model.position_embedding,
            )
        self.eos_id = document_end_token(model, eos_id)

    def forward(
        self, tokens: Tensor, positions: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """`positions` [batch, seq]: where the tokens sit (decoding). Without them: 0 ..
        seq-1; or, under the document mask, each token's position in its document, and
        the result is (hidden states, ends [batch, seq]: True at each EOS)."""
        if positions is not None:
            return super().forward(tokens, positions)
        if self.eos_id is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            return super().forward(tokens, positions)
        ends = tokens == self.eos_id
        return super().forward(tokens, documents(ends).positions), ends


class DecoderLayer(TransformerLayer):
    """One pre-norm decoder layer: x += attention(norm(x)); x += mlp(norm(x)).

    Takes and returns the hidden states, or under model.attention_mask=document (hidden
    states, document ends), so it is also a pipeline stage; RoPE angles (at each token's
    position in its document, with documents) are computed here rather than passed between
    stages, and the documents go to the core attention as megatron's attention_mask.
    `recompute` is
    train.activation_checkpointing: none; selective recomputes the core attention in
    backward; full recomputes the whole layer (only its input is kept). `decoding` (this
    layer's cache and the step) makes it continue a cached sequence. With
    model.compile=layer, training runs the whole layer
    through torch.compile (one graph for norms, projections, attention and MLP, fused where
    Inductor can); evaluation and decoding stay eager (a cache is Python state, and
    shapes that change every step would recompile).
    """

    def __init__(
        self,
        config: TransformerConfig,
        model: ModelConfig,
        layer_number: int,
        seed: int,
        recompute: str = "none",
    ):
        with seeded_init(seed):
            super().__init__(
                config=config,
                submodules=decoder_layer_spec(model, recompute).submodules,
                layer_number=layer_number,
            )
        self.recompute = recompute == "full"
        self.rope_base = model.rotary_base if model.position_embedding == "rope" else None
        # lazy: compiles at the first training forward (once for all layers: the layers
        # differ only in their weights, which the graph takes as inputs)
        self.compiled = torch.compile(self._forward) if model.compile == "layer" else None

    def forward(  # type: ignore[override]
        self,
        inputs: Tensor | tuple[Tensor, Tensor],
        decoding: tuple[LayerCache, DecodeStep] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        hidden_states, ends = inputs if isinstance(inputs, tuple) else (inputs, None)
        if decoding is not None or not self.training:
            output = self._forward(hidden_states, ends, decoding)
        else:
            layer = self.compiled or self._forward
            if self.recompute and torch.is_grad_enabled():
                output = torch.utils.checkpoint.checkpoint(
                    layer, hidden_states, ends, use_reentrant=False
                )
            else:
                output = layer(hidden_states, ends)
        return output if ends is None else (output, ends)

    def _forward(
        self,
        hidden_states: Tensor,
        ends: Tensor | None = None,
        decoding: tuple[LayerCache, DecodeStep] | None = None,
    ) -> Tensor:
        docs = None if ends is None else documents(ends)
        positions = None  # 0 .. seq-1 in every row
        if decoding is not None:
            positions = decoding[1].positions
        elif docs is not None:
            positions = docs.positions
        rope, dim = None, self.config.kv_channels
        if self.rope_base is not None and positions is None:
            seq_len = hidden_states.shape[0]  # this rank's part under sequence parallelism
            if self.config.sequence_parallel:
                seq_len *= self.config.tensor_model_parallel_size
            rope = rotary_frequencies(seq_len, dim, self.rope_base, hidden_states.device)
        elif self.rope_base is not None:  # each row's own positions: [seq, batch, 1, dim]
            rope = rotary_angles(positions.t(), dim, self.rope_base).unsqueeze(2)
        if decoding is None:  # (training's path, compiled: no context variable in it)
            output, _ = super().forward(hidden_states, attention_mask=docs, rotary_pos_emb=rope)
            return output
        # megatron's SelfAttention has no argument to hand the core attention a cache of
        # ours: it is the core attention's DECODING for this one call
        scope = DECODING.set(decoding)
        try:
            output, _ = super().forward(hidden_states, attention_mask=None, rotary_pos_emb=rope)
        finally:
            DECODING.reset(scope)
        return output


def vocab_parallel_logits(
    hidden: Tensor, weight: Tensor, sequence_parallel: bool = False
) -> Tensor:
    """Logits for this rank's vocabulary shard of the whole sequence (loss.tensor_parallel_input:
    `hidden` all-gathered under sequence parallelism, else its gradient summed over TP)."""
    return F.linear(tensor_parallel_input(hidden, sequence_parallel), weight)


class _DropsDocumentEnds:
    """The final norm takes what the last decoder layer returns: the hidden states, or
    (hidden states, document ends), whose marks it drops."""

    def forward(self, inputs: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        return super().forward(inputs[0] if isinstance(inputs, tuple) else inputs)


class FinalLayerNorm(_DropsDocumentEnds, LayerNorm):
    """The sequence-parallel aware LayerNorm after the last decoder layer."""


class FinalRMSNorm(_DropsDocumentEnds, RMSNorm):
    """The sequence-parallel aware RMSNorm after the last decoder layer."""


def final_norm_class(config: TransformerConfig) -> type[torch.nn.Module]:
    """hidden_norm_class's norm taking the last layer's output as it comes; built with
    (hidden_size, eps=..., sequence_parallel=config.sequence_parallel)."""
    return FinalRMSNorm if config.normalization == "RMSNorm" else FinalLayerNorm


class OutputLayer(ColumnParallelLinear):
    """Last stage: hidden [seq, batch, hidden] -> logits [seq, batch, vocab / TP].
    With tied embeddings it owns no weight and is handed the embedding's. Given labels it
    returns the loss instead (LossTerms: with the z-loss of coefficient `z_loss`,
    train.z_loss), inside this module's forward, where ZeRO-3 has gathered its weight; with
    `loss_chunk_tokens` (train.loss_chunk_tokens) computed that many tokens at a time with
    its GEMM, so the logits never exist whole."""

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        tied: bool,
        seed: int,
        loss_chunk_tokens: int = 0,
        z_loss: float = 0.0,
    ):
        with seeded_init(seed):
            super().__init__(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                gather_output=False,
                skip_weight_param_allocation=tied,
            )
        self.loss_chunk_tokens, self.z_loss = loss_chunk_tokens, z_loss

    def forward(  # type: ignore[override]
        self, hidden: Tensor, tied_weight: Tensor | None = None, labels: Tensor | None = None
    ) -> Tensor | LossTerms:
        weight = self.weight if tied_weight is None else tied_weight
        sequence_parallel = self.sequence_parallel
        if labels is None:
            return vocab_parallel_logits(hidden, weight, sequence_parallel)
        if self.loss_chunk_tokens:
            return chunked_lm_loss(
                hidden, weight, labels, self.loss_chunk_tokens, self.z_loss, sequence_parallel
            )
        return lm_loss(
            vocab_parallel_logits(hidden, weight, sequence_parallel), labels, self.z_loss
        )


def stage_seed(seed: int, stage_index: int) -> int:
    """Init seed of model part `stage_index` (0: embedding, 1..L: layers, L+1: output)."""
    return derived_seed(seed, stage_index)


class BeliefLM(MegatronModule):
    """The whole model in one process (tensor parallelism inside the layers). The pipeline
    (belief_lm/model/pipeline.py) is built from the same parts with the same seeds.
    `recompute` (train.activation_checkpointing) and `loss_chunk_tokens`
    (train.loss_chunk_tokens) change how training computes, never the result, and so does
    `sequence_parallel` (parallel.sequence_parallel, resolved); `z_loss` (train.z_loss)
    adds the z-loss to the objective, reported by get_additional_losses. `eos_id` (the
    tokenizer's EOS) is where documents end under model.attention_mask=document. Decoding
    with a cache needs sequence parallelism off (evaluation and generation build the model
    without it: it changes no weight)."""

    def __init__(
        self,
        model: ModelConfig,
        vocab_size: int,
        tensor_parallel: int = 1,
        seed: int = 0,
        *,
        recompute: str = "none",
        loss_chunk_tokens: int = 0,
        eos_id: int | None = None,
        z_loss: float = 0.0,
        sequence_parallel: bool = False,
    ):
        config = transformer_config(model, tensor_parallel, sequence_parallel)
        super().__init__(config=config)
        self.model_config = model
        self.embedding = TokenEmbedding(config, model, vocab_size, stage_seed(seed, 0), eos_id)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, model, i + 1, stage_seed(seed, i + 1), recompute)
            for i in range(model.num_layers)
        )
        self.final_norm = final_norm_class(config)(
            config.hidden_size, eps=config.layernorm_epsilon,
            sequence_parallel=config.sequence_parallel,
        )  # fmt: skip
        self.output_layer = OutputLayer(
            config, vocab_size, model.tie_embeddings, stage_seed(seed, model.num_layers + 1),
            loss_chunk_tokens, z_loss,
        )  # fmt: skip
        self.z_loss = z_loss
        self.last_z_loss = torch.zeros(())  # of the last forward given labels
        sum_sequence_parallel_grads(self)

    def forward(
        self, tokens: Tensor, labels: Tensor | None = None, cache: DecodeCache | None = None
    ) -> Tensor:
        """Logits [seq, batch, vocab / TP], or the mean loss when labels are given (its
        gradient the objective's, with the z-loss). With a `cache` (from `decode_cache`),
        `tokens` continue what it holds, and are added to it."""
        with record_function("forward"):  # a phase of a profiled step
            if cache is None:
                hidden = self.embedding(tokens)
                for layer in self.layers:
                    hidden = layer(hidden)
            else:
                if self.config.sequence_parallel:
                    raise ValueError("decoding with a cache needs sequence parallelism off")
                hidden = self._decode(tokens, cache)
            hidden = self.final_norm(hidden)
        tied = self.embedding.word_embeddings.weight if self.model_config.tie_embeddings else None
        if labels is None:
            return self.output_layer(hidden, tied)
        with record_function("loss"):
            loss, self.last_z_loss = self.output_layer(hidden, tied, labels)
        return loss

    def get_additional_losses(self) -> dict[str, Tensor] | None:
        """What the last forward given labels computed beside its loss, as DeepSpeed's
        pipeline engine asks a PipelineModule: {"z_loss": its z-loss term} with
        train.z_loss, else None."""
        return {"z_loss": self.last_z_loss} if self.z_loss else None

    def _decode(self, tokens: Tensor, cache: DecodeCache) -> Tensor:
        """Hidden states [seq, batch, hidden] of `tokens` continuing `cache`: one step, or
        with documents one per run of tokens up to an EOS (DecodeCache.steps)."""
        valid = torch.ones_like(tokens, dtype=torch.bool)
        eos_id = self.embedding.eos_id
        ends = None if eos_id is None else tokens == eos_id
        parts = []
        for run, step in cache.steps(valid, ends):
            hidden = self.embedding(tokens[:, run], step.positions)
            for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
                hidden = layer(hidden, (layer_cache, step))
            parts.append(hidden)
        return torch.cat(parts)

    def decode_cache(self) -> DecodeCache:
        """An empty cache for decoding with `forward(tokens, cache=...)`."""
        model = self.model_config
        mixing = model.variant.mixing
        return DecodeCache(model.num_layers, mixing, model.head_scales)
