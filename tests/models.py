"""Small model configurations the tests share: the two architecture families at the size
of make_checkpoint (tests/conftest.py), and random token ids from the small tokenizer."""

import torch

from belief_lm.variants import VARIANTS

SMALL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4}
SMALL |= {"ffn_hidden_size": 48, "seq_length": 16, "init_std": 0.3}
"""ModelConfig fields of the tests' small models (2 layers, width 32, 16 positions)."""

GPT2_LIKE = {
    "normalization": "LayerNorm",
    "activation": "gelu",
    "position_embedding": "learned_absolute",
    "tie_embeddings": True,
    "bias": True,
}
LLAMA_LIKE = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding": "rope",
    "rotary_base": 500.0,
    "num_query_groups": 2,
    "tie_embeddings": False,
    "bias": False,
}
ARCHITECTURES = {"gpt2": GPT2_LIKE, "llama": LLAMA_LIKE}
VARIANTS_AND_ARCHITECTURES = [(variant, "llama") for variant in VARIANTS] + [
    ("belief_star", "gpt2"),
    ("attention_bn_sh", "gpt2"),
]
"""Every variant at the harder architecture (RoPE, GQA), two at the other (learned positions)."""


def tokens(n: int, seed: int = 0, rows: int = 2) -> torch.Tensor:
    """Random ids [rows, n] of the small tokenizer's 400."""
    return torch.randint(0, 400, (rows, n), generator=torch.Generator().manual_seed(seed))
