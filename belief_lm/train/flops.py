"""Model FLOPs per token and utilisation (MFU).

Counts matrix multiplies only, forward + backward = 3 x forward, as PaLM's appendix B and
Megatron do: 6 FLOPs per matmul weight per token (the weights the model's description,
belief_lm.description, marks as a matmul's), plus the attention scores and weighted
sums, 12 x layers x seq x hidden per token (counted for the full, not the causal, square).
belief's projections are elementwise and not counted; belief_star's W^s is a matmul and is.
Activation recompute runs part of the forward again (recompute_flops_per_token); MFU does
not count it, the time a step takes does. Torch-free but for peak_tflops (the planner,
belief_lm/plan.py, runs without torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from belief_lm.config import ModelConfig
from belief_lm.description import describe, layer_weights, matmul_count

if TYPE_CHECKING:
    import torch

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


def layer_matmul_weights(model: ModelConfig) -> int:
    """Matmul weights of one decoder layer (the description's): QKV, W^o (and belief_star's
    W^s), the MLP."""
    return matmul_count(layer_weights(model))


def matmul_weights(model: ModelConfig, vocab_size: int) -> int:
    """Weights used in matrix multiplies (the description's: embedding lookups and norms
    excluded, the output layer's counted once, tied or not)."""
    return describe(model, vocab_size).matmul_weights()


def attention_flops_per_token(model: ModelConfig) -> float:
    """The attention scores and weighted sums, forward and backward, per token."""
    return 12 * model.num_layers * model.seq_length * model.hidden_size


def flops_per_token(model: ModelConfig, vocab_size: int) -> float:
    """Training FLOPs per token (forward and backward)."""
    return 6 * matmul_weights(model, vocab_size) + attention_flops_per_token(model)


def recompute_flops_per_token(model: ModelConfig, recompute: str) -> float:
    """FLOPs per token that train.activation_checkpointing adds: full reruns every
    decoder layer's forward (a third of its training FLOPs), selective only the attention
    scores and weighted sums (the matmuls of the attention core)."""
    if recompute == "full":
        layers = 6 * model.num_layers * layer_matmul_weights(model)
        return (layers + attention_flops_per_token(model)) / 3
    if recompute == "selective":
        return attention_flops_per_token(model) / 3
    return 0.0


def loss_recompute_flops_per_token(model: ModelConfig, vocab_size: int, chunk_tokens: int) -> float:
    """FLOPs per token that train.loss_chunk_tokens adds: the output GEMM's forward again."""
    return 2.0 * model.hidden_size * vocab_size if chunk_tokens else 0.0


def peak_tflops(device: torch.device, configured: float | None) -> float | None:
    """Peak TFLOP/s of one device: the configured value, else a known GPU's, else None."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_DENSE_BF16_TFLOPS.items() if k in name), None)
