"""Configuration of a belief-lm model exported for Hugging Face transformers.

Shipped with the weights (loaded with trust_remote_code=True); needs only torch and
transformers. Field meanings follow belief-lm's ModelConfig.
"""

from transformers import PretrainedConfig


class BeliefLMConfig(PretrainedConfig):
    """A decoder-only LM whose attention is one of the belief-attention family."""

    model_type = "belief_lm"

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 128,
        normalization: str = "LayerNorm",
        norm_epsilon: float = 1e-5,
        qk_norm: bool = False,
        activation: str = "gelu",
        position_embedding: str = "learned_absolute",
        rotary_base: float = 10000.0,
        bias: bool = True,
        attention: str = "softmax",
        gamma: float = 0.5,
        beta: float = 1.0,
        head_scales: list[int] | None = None,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.normalization = normalization  # "LayerNorm" or "RMSNorm"
        self.norm_epsilon = norm_epsilon
        self.qk_norm = qk_norm  # RMSNorm of each head's queries and keys before RoPE
        self.activation = activation  # "gelu" or "swiglu"
        self.position_embedding = position_embedding  # "learned_absolute" or "rope"
        self.rotary_base = rotary_base
        self.bias = bias
        # softmax, belief, belief_star, attentionx, attention_bn, attention_sh, attention_bn_sh
        self.attention = attention
        self.gamma = gamma  # AttentionX's Φ = γV - H
        self.beta = beta  # Attention-BN's weight of the key mean
        self.head_scales = list(head_scales or [1] * num_attention_heads)  # Attention-SH
        # generation keeps a cache of every layer's state (False: recompute every step)
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
