"""A belief-lm model as a Hugging Face transformers causal LM, in plain PyTorch.

Shipped with exported weights (load with trust_remote_code=True); needs only torch and
transformers. `belief_attention.py` beside it is belief-lm's own attention math, copied
at export, so the variants compute exactly what training computed.

The layout is belief-lm's (megatron-core's): token (+ learned position) embedding, pre-norm
decoder layers x += attn(norm(x)); x += mlp(norm(x)), a final norm and a tied or untied
head. RoPE is megatron's non-interleaved form (rotate the two halves of each head); with
qk_norm each head's queries and keys go through an RMSNorm (q_norm, k_norm: one weight of
head_dim each, as Qwen3's) before it.

Attention is causal. `generate` decodes with a cache of every variant's state
(`BeliefLMCache`: belief_attention.DecodeCache; use_cache=True by default): the prompt runs
once, then each step feeds the new token. An attention mask may mark padding (0): a padded
token takes no position and no token attends to it, so a left-padded batch gives each row
what it gives alone. Once a row is longer than max_position_embeddings, every step reruns
the model over the last max_position_embeddings tokens without the cache, as belief-lm's
own generator does (the crop moves every position, so nothing cached stays valid).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .belief_attention import (
    DecodeCache,
    DecodeStep,
    LayerCache,
    attention_heads,
    heads_from_groups,
    residual_signal,
    rotary_angles,
)
from .configuration_belief_lm import BeliefLMConfig
from .variants import VARIANTS

# the output's field for the cache: `cache` since transformers 5, `past_key_values` before
CACHE_FIELD = next(
    f for f in ("cache", "past_key_values") if f in CausalLMOutputWithPast.__dataclass_fields__
)


def norm(config: BeliefLMConfig) -> nn.Module:
    cls = nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm
    return cls(config.hidden_size, eps=config.norm_epsilon)


class BeliefLMCache(DecodeCache):
    """What generation keeps between steps: every layer's cached slots (see
    belief_attention.py) and the tokens each row has fed."""

    def __init__(self, config: BeliefLMConfig):
        mixing = VARIANTS[config.attention][0]
        super().__init__(config.num_hidden_layers, mixing, config.head_scales)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens fed per row, padding included (what transformers asks a cache)."""
        return self.columns


def apply_rotary(x: Tensor, angles: Tensor) -> Tensor:
    """x [b, heads, s, d] rotated by angles [b or 1, s, d]: x cos + rotate_half(x) sin (cos
    and sin in x's dtype, as megatron applies them)."""
    angles = angles.unsqueeze(1)  # the same for every head
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class BeliefLMAttention(nn.Module):
    """Q, K, V projections (GQA), the variant's core and the output projection(s)."""

    def __init__(self, config: BeliefLMConfig):
        super().__init__()
        self.config = config
        self.variant = VARIANTS[config.attention]
        self.mixing, self.residual = self.variant
        self.heads, self.groups = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        width, bias = config.hidden_size, config.bias
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.groups * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.groups * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=bias)  # W^o
        if self.variant.extra_projection:
            self.s_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)  # W^s
        if config.qk_norm:  # per head, before RoPE
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_epsilon)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_epsilon)

    def forward(
        self, x: Tensor, angles: Tensor | None, cache: LayerCache | None, step: DecodeStep | None
    ) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.groups, self.head_dim).transpose(1, 2)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if angles is not None:
            q, k = apply_rotary(q, angles), apply_rotary(k, angles)
        c = self.config
        h = attention_heads(
            q, k, v, self.mixing, beta=c.beta, head_scales=c.head_scales, cache=cache, step=step
        )
        v_heads = heads_from_groups(v, self.heads)
        signal = residual_signal(h.transpose(1, 2), v_heads.transpose(1, 2), self.residual, c.gamma)
        if not self.variant.extra_projection:
            return self.o_proj(signal)
        delta, delta_s = signal.chunk(2, dim=-1)
        return self.o_proj(delta) + self.s_proj(delta_s)


class BeliefLMMLP(nn.Module):
    """up -> GELU -> down, or SwiGLU: down(silu(gate) * up)."""

    def __init__(self, config: BeliefLMConfig):
        super().__init__()
        width, inner, bias = config.hidden_size, config.intermediate_size, config.bias
        self.swiglu = config.activation == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(width, inner, bias=bias)
        self.up_proj = nn.Linear(width, inner, bias=bias)
        self.down_proj = nn.Linear(inner, width, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class BeliefLMDecoderLayer(nn.Module):
    def __init__(self, config: BeliefLMConfig):
        super().__init__()
        self.input_layernorm = norm(config)
        self.self_attn = BeliefLMAttention(config)
        self.post_attention_layernorm = norm(config)
        self.mlp = BeliefLMMLP(config)

    def forward(
        self, x: Tensor, angles: Tensor | None, cache: LayerCache | None, step: DecodeStep | None
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles, cache, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class BeliefLMPreTrainedModel(PreTrainedModel):
    config_class = BeliefLMConfig
    base_model_prefix = "model"

    def _init_weights(self, module: nn.Module) -> None:
        """Only used for weights a checkpoint lacks (training happens in belief-lm)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


class BeliefLMModel(BeliefLMPreTrainedModel):
    """Embeddings, decoder layers and the final norm: hidden states [b, s, hidden]."""

    def __init__(self, config: BeliefLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned_absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            BeliefLMDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = norm(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self, input_ids: Tensor, cache: BeliefLMCache | None = None, valid: Tensor | None = None
    ) -> Tensor:
        """Hidden states of `input_ids` [b, s]; with a cache they continue what it holds
        and are added to it, and `valid` [b, s] (the attention mask) marks padding."""
        c, step = self.config, None
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        if cache is not None:
            step = cache.step(torch.ones_like(input_ids, dtype=torch.bool) if valid is None
                              else valid.bool())  # fmt: skip
            positions = step.positions
        x = self.embed_tokens(input_ids)
        angles = None
        if c.position_embedding == "learned_absolute":
            if positions.max() >= c.max_position_embeddings:
                raise ValueError(
                    f"{int(positions.max()) + 1} tokens exceed the "
                    f"{c.max_position_embeddings} learned positions"
                )
            x = x + self.embed_positions(positions)
        else:
            angles = rotary_angles(positions, c.hidden_size // c.num_attention_heads, c.rotary_base)
        for i, layer in enumerate(self.layers):
            x = layer(x, angles, None if cache is None else cache.layers[i], step)
        return self.norm(x)


class BeliefLMForCausalLM(BeliefLMPreTrainedModel, GenerationMixin):
    """BeliefLMModel and the LM head (the token embedding when tied)."""

    def __init__(self, config: BeliefLMConfig):
        super().__init__(config)
        self.model = BeliefLMModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module | None:
        return None if self.config.tie_word_embeddings else self.lm_head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """generate must not make a DynamicCache: forward makes a BeliefLMCache."""
        return False

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        cache: BeliefLMCache | None = None,
        past_key_values: BeliefLMCache | None = None,
        **unused,
    ) -> CausalLMOutputWithPast:
        """Logits [b, s, vocab] of `input_ids`; with a `cache` (or `past_key_values`),
        `input_ids` continue what it holds. `use_cache` (default: config.use_cache) returns
        the cache, a new one if none was given. A mask with zeros (padding) is computed
        through a cache, kept or not."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        padded = attention_mask is not None and not bool(attention_mask.all())
        if cache is None and (use_cache or padded):
            cache = BeliefLMCache(self.config)
        # transformers passes the mask of every token so far: these tokens' are the last
        valid = None if attention_mask is None else attention_mask[:, -input_ids.shape[1] :]
        hidden = self.model(input_ids, cache, valid)
        if self.config.tie_word_embeddings:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # labels are the inputs (shifted here), as in transformers
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        kept = {CACHE_FIELD: cache if use_cache else None}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **kept)

    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> dict:
        """The tokens the cache does not hold yet; or, without a cache or once a row no
        longer fits in max_position_embeddings, the whole context cropped to its last
        max_position_embeddings tokens (a crop moves every position: no cache then)."""
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        use_cache = self.config.use_cache if use_cache is None else use_cache
        window = self.config.max_position_embeddings
        tokens = input_ids.shape[1] if attention_mask is None else int(attention_mask.sum(-1).max())
        if not use_cache or tokens > window:
            keep = slice(-window, None)
            mask = None if attention_mask is None else attention_mask[:, keep]
            return {"input_ids": input_ids[:, keep], "attention_mask": mask, "use_cache": False}
        fed = 0 if cache is None else cache.columns
        return {
            "input_ids": input_ids[:, fed:],
            "attention_mask": attention_mask,
            "cache": cache,
            "use_cache": True,
        }
