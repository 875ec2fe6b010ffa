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
are [batch, seq].

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
from megatron.core.tensor_parallel import ColumnParallelLinear, copy_to_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor

from belief_lm.attention import DecodeCache, DecodeStep, LayerCache, rotary_angles
from belief_lm.compat import ColumnLinear, RowLinear
from belief_lm.config import ModelConfig
from belief_lm.model.attention_layer import (
    DECODING,
    BeliefStarProjection,
    HeadNorm,
    core_attention_spec,
)
from belief_lm.model.loss import LossTerms, chunked_lm_loss, lm_loss
from belief_lm.runtime import derived_seed


def transformer_config(cfg: ModelConfig, tensor_parallel: int = 1) -> TransformerConfig:
    """megatron's TransformerConfig for our model config.

    Fusions that need apex/TransformerEngine stay off (they are CUDA-only and optional);
    pipeline_model_parallel_size stays 1 because DeepSpeed owns the pipeline (otherwise
    TransformerLayer offsets layer numbers by the pipeline rank).
    """
    swiglu = cfg.activation == "swiglu"
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
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = core_attention_spec(
        cfg.attention, cfg.gamma, cfg.beta, cfg.head_scales, fused=cfg.compile == "projections",
        recompute=recompute == "selective",
    )  # fmt: skip
    if cfg.compile == "layer":  # megatron's own otherwise: its private call is overridden
        attention.linear_proj = spec.submodules.mlp.submodules.linear_fc2 = RowLinear
        attention.linear_qkv = spec.submodules.mlp.submodules.linear_fc1 = ColumnLinear
    if cfg.variant.extra_projection:
        fused = cfg.fused_output_projection
        attention.linear_proj = ModuleSpec(module=BeliefStarProjection, params={"fused": fused})
    if cfg.qk_norm:  # megatron's own slots (IdentityOp otherwise), applied before RoPE;
        # TransformerConfig.qk_layernorm stays False: it only picks these in megatron's
        # specs and sums their gradients in finalize_model_grads, which HeadNorm does itself
        attention.q_layernorm = attention.k_layernorm = HeadNorm
    return spec


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


class TokenEmbedding(LanguageModelEmbedding):
    """Stage 0: token ids [batch, seq] -> hidden states [seq, batch, hidden]."""

    def __init__(self, config: TransformerConfig, model: ModelConfig, vocab_size: int, seed: int):
        with seeded_init(seed):
            super().__init__(
                config=config,
                vocab_size=vocab_size,
                max_sequence_length=model.seq_length,
                position_embedding_type=model.position_embedding,
            )

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        """`positions` [batch, seq]: where the tokens sit (default 0 .. seq-1)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return super().forward(tokens, positions)


class DecoderLayer(TransformerLayer):
    """One pre-norm decoder layer: x += attention(norm(x)); x += mlp(norm(x)).

    Takes and returns only the hidden states, so it is also a pipeline stage; RoPE angles
    are computed (and cached) here rather than passed between stages. `recompute` is
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
        self, hidden_states: Tensor, decoding: tuple[LayerCache, DecodeStep] | None = None
    ) -> Tensor:
        if decoding is not None or not self.training:
            return self._forward(hidden_states, decoding)
        layer = self.compiled or self._forward
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(layer, hidden_states, use_reentrant=False)
        return layer(hidden_states)

    def _forward(
        self, hidden_states: Tensor, decoding: tuple[LayerCache, DecodeStep] | None = None
    ) -> Tensor:
        rope, dim = None, self.config.kv_channels
        if self.rope_base is not None and decoding is None:
            rope = rotary_frequencies(hidden_states.shape[0], dim, self.rope_base,
                                      hidden_states.device)  # fmt: skip
        elif self.rope_base is not None:  # each row's own positions: [seq, batch, 1, dim]
            rope = rotary_angles(decoding[1].positions.t(), dim, self.rope_base).unsqueeze(2)
        if decoding is None:  # (training's path, compiled: no context variable in it)
            output, _ = super().forward(hidden_states, attention_mask=None, rotary_pos_emb=rope)
            return output
        # megatron's SelfAttention has no argument to hand the core attention a cache of
        # ours: it is the core attention's DECODING for this one call
        scope = DECODING.set(decoding)
        try:
            output, _ = super().forward(hidden_states, attention_mask=None, rotary_pos_emb=rope)
        finally:
            DECODING.reset(scope)
        return output


def final_norm_class(config: TransformerConfig) -> type[torch.nn.Module]:
    """torch's LayerNorm or RMSNorm, as megatron's local spec uses in the layers; built
    with (hidden_size, eps=layernorm_epsilon)."""
    return torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm


def vocab_parallel_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """Logits for this rank's vocabulary shard: the input is replicated over TP ranks, so
    its gradient is summed over them (megatron's copy-to-TP region) before the matmul."""
    return F.linear(copy_to_tensor_model_parallel_region(hidden), weight)


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
        if labels is None:
            return vocab_parallel_logits(hidden, weight)
        if self.loss_chunk_tokens:
            return chunked_lm_loss(hidden, weight, labels, self.loss_chunk_tokens, self.z_loss)
        return lm_loss(vocab_parallel_logits(hidden, weight), labels, self.z_loss)


def stage_seed(seed: int, stage_index: int) -> int:
    """Init seed of model part `stage_index` (0: embedding, 1..L: layers, L+1: output)."""
    return derived_seed(seed, stage_index)


class BeliefLM(MegatronModule):
    """The whole model in one process (tensor parallelism inside the layers). The pipeline
    (belief_lm/model/pipeline.py) is built from the same parts with the same seeds.
    `recompute` (train.activation_checkpointing) and `loss_chunk_tokens`
    (train.loss_chunk_tokens) change how training computes, never the result; `z_loss`
    (train.z_loss) adds the z-loss to the objective, reported by get_additional_losses."""

    def __init__(
        self,
        model: ModelConfig,
        vocab_size: int,
        tensor_parallel: int = 1,
        seed: int = 0,
        *,
        recompute: str = "none",
        loss_chunk_tokens: int = 0,
        z_loss: float = 0.0,
    ):
        config = transformer_config(model, tensor_parallel)
        super().__init__(config=config)
        self.model_config = model
        self.embedding = TokenEmbedding(config, model, vocab_size, stage_seed(seed, 0))
        self.layers = torch.nn.ModuleList(
            DecoderLayer(config, model, i + 1, stage_seed(seed, i + 1), recompute)
            for i in range(model.num_layers)
        )
        self.final_norm = final_norm_class(config)(config.hidden_size, eps=config.layernorm_epsilon)
        self.output_layer = OutputLayer(
            config, vocab_size, model.tie_embeddings, stage_seed(seed, model.num_layers + 1),
            loss_chunk_tokens, z_loss,
        )  # fmt: skip
        self.z_loss = z_loss
        self.last_z_loss = torch.zeros(())  # of the last forward given labels

    def forward(
        self, tokens: Tensor, labels: Tensor | None = None, cache: DecodeCache | None = None
    ) -> Tensor:
        """Logits [seq, batch, vocab / TP], or the mean loss when labels are given (its
        gradient the objective's, with the z-loss). With a `cache` (from `decode_cache`),
        `tokens` continue what it holds, and are added to it."""
        if cache is None:
            hidden = self.embedding(tokens)
            for layer in self.layers:
                hidden = layer(hidden)
        else:
            step = cache.step(torch.ones_like(tokens, dtype=torch.bool))
            hidden = self.embedding(tokens, step.positions)
            for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
                hidden = layer(hidden, (layer_cache, step))
        tied = self.embedding.word_embeddings.weight if self.model_config.tie_embeddings else None
        hidden = self.final_norm(hidden)
        if labels is None:
            return self.output_layer(hidden, tied)
        loss, self.last_z_loss = self.output_layer(hidden, tied, labels)
        return loss

    def get_additional_losses(self) -> dict[str, Tensor] | None:
        """What the last forward given labels computed beside its loss, as DeepSpeed's
        pipeline engine asks a PipelineModule: {"z_loss": its z-loss term} with
        train.z_loss, else None."""
        return {"z_loss": self.last_z_loss} if self.z_loss else None

    def decode_cache(self) -> DecodeCache:
        """An empty cache for decoding with `forward(tokens, cache=...)`."""
        model = self.model_config
        mixing = model.variant.mixing
        return DecodeCache(model.num_layers, mixing, model.head_scales)
