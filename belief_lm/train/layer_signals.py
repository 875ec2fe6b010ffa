"""Per-layer signals at run.diagnostics_interval, and which layers a loss spike came from.

For every decoder layer: `max_logit`, the largest pre-softmax attention score over the heads,
queries and keys of a training micro-batch, as the layer's variant defines its scores
(belief_lm.attention.max_logit); `output_rms`, the RMS of the hidden states the layer hands
on; `grad_norm`, the 2-norm of the gradient of the layer's weights, taken between backward
and the optimizer step (DeepSpeed's safe_get_full_grad: whole gradients at every ZeRO
stage; tensor-parallel shards summed, replicated weights counted once; with a pipeline,
inside the engine's train_batch before its optimizer step, every stage's layers on every
rank). The first two come from the belief diagnostics' forward pass
(belief_lm/train/diagnostics.py); a spike step's gradient norms are compared with the last
diagnostics step's to name the layers whose gradient grew most. Logged as `layer{n}/...` in
metrics.jsonl, under `layers/` in tensorboard and W&B.
"""

from __future__ import annotations

import torch

from belief_lm.parallel.gather import counted_once

FORWARD = ("max_logit", "output_rms")
"""The signals measured in the diagnostics' forward pass."""
GRAD_NORM = "grad_norm"
MOST_GROWN = 3
"""How many layers a spike names."""


def is_forward_signal(key: str) -> bool:
    """Whether `key` (`layer{n}/name`) is one of FORWARD's."""
    return key.rsplit("/", 1)[-1] in FORWARD


def merge(parts: list[dict]) -> dict:
    """One dict from every rank's: a layer's max_logit is the largest of its TP ranks'
    (each holds some heads); the other numbers are the same on every rank holding the
    layer."""
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            keep = key.endswith("/max_logit") and key in merged
            merged[key] = max(merged[key], value) if keep else value
    return merged


def layer_grad_norms(module: torch.nn.Module) -> dict[str, float]:
    """{'layer{n}/grad_norm': ...} for every decoder layer of the whole model, on every rank
    (collective: every rank calls it between the step's last backward and the optimizer
    step; with a pipeline, from the engine's OptimizerStep: Trainee.before_update). Each
    rank squares what it holds of its layers' gradients (tensor-parallel shards; a weight
    replicated over TP on TP rank 0 only), each layer in its place of a vector over all
    layers, summed over the model-parallel group (TP x PP): each pipeline stage adds its
    own layers (preflight gives every stage one at least), each TP rank its shards."""
    from deepspeed.utils import safe_get_full_grad

    from belief_lm.model.gpt import DecoderLayer
    from belief_lm.parallel.collectives import TensorParallelPlace, model_parallel_sum

    tp_rank = TensorParallelPlace.here().rank  # megatron's group, which the grid made
    layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        return {}
    squares = torch.zeros(layers[0].config.num_layers, dtype=torch.float64)
    for layer in layers:
        for param in layer.parameters():
            grad = safe_get_full_grad(param)  # collective at ZeRO-1/2/3: every rank, every param
            if grad is not None and counted_once(param, tp_rank):
                squares[layer.layer_number - 1] += grad.double().square().sum().cpu()
    totals = model_parallel_sum(squares)
    return {f"layer{n}/{GRAD_NORM}": float(value.sqrt()) for n, value in enumerate(totals, 1)}


def grown_most(before: dict[str, float], now: dict[str, float], count: int = MOST_GROWN):
    """The `count` layers whose gradient norm grew most from `before` to `now` (by ratio),
    as [(layer name, ratio)], largest first."""
    ratios = []
    for key, value in now.items():
        if key.endswith(f"/{GRAD_NORM}") and before.get(key):
            ratios.append((key.split("/")[0], value / before[key]))
    return sorted(ratios, key=lambda item: item[1], reverse=True)[:count]


class GradientWatch:
    """The per-layer gradient norms the trainer keeps: the last diagnostics step's (what a
    spike is compared with), and those measured before the coming update when asked."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.reference: dict[str, float] = {}
        """The norms of the last step they were measured at (diagnostics or spike)."""
        self.measured: dict[str, float] = {}
        """This step's norms, once measured (empty otherwise)."""

    def measure(self) -> dict[str, float]:
        """This step's norms (collective; between backward and the optimizer step)."""
        self.measured = layer_grad_norms(self.module)
        return self.measured

    def spike_report(self) -> tuple[dict[str, float], list[tuple[str, float]]]:
        """This step's norms (measured now if they were not) and the layers whose norm grew
        most since the reference (collective)."""
        if not self.measured:
            self.measure()
        return self.measured, grown_most(self.reference, self.measured)

    def step_done(self) -> None:
        """The step is over: its norms, if measured, are the reference from now on."""
        if self.measured:
            self.reference, self.measured = self.measured, {}
