"""Model FLOPs per token and utilisation (MFU).

Counts matrix multiplies only, forward + backward = 3 x forward, as PaLM's appendix B and
Megatron do: 6 FLOPs per matmul weight per token, plus the attention scores and weighted
sums, 12 x layers x seq x hidden per token (counted for the full, not the causal, square).
belief's projections are elementwise and not counted; belief_star's W^s is a matmul and is.
"""

from __future__ import annotations

import torch

from belief_lm.config import ModelConfig

PEAK_DENSE_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200 NVL": 835.0,
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
}
"""Vendor peak dense bf16 TFLOP/s by device-name substring, the first that matches (so the
PCIe and NVL boards come before the SXM figure of their name)."""


def matmul_weights(model: ModelConfig, vocab_size: int) -> int:
    """Weights used in matrix multiplies (embedding lookups and norms excluded)."""
    hidden, ffn = model.hidden_size, model.ffn_size
    qkv = hidden * (model.num_attention_heads + 2 * model.query_groups) * model.head_dim
    out = hidden * hidden * (2 if model.attention == "belief_star" else 1)
    mlp = hidden * ffn * (3 if model.activation == "swiglu" else 2)
    return model.num_layers * (qkv + out + mlp) + hidden * vocab_size


def flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token (forward and backward)."""
    attention = 12 * model.num_layers * model.seq_length * model.hidden_size
    return 6 * matmul_weights(model, vocab_size) + attention


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Peak TFLOP/s of one device: the configured value, else a known GPU's, else None."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_DENSE_BF16_TFLOPS.items() if k in name), None)
