"""Belief diagnostics per layer (BeliefFormer Fig. 4), measured on a training batch.

For every decoder layer, averaged over tokens: ||Δ|| / ||MH|| (Δ the global orthogonal
residual of MH against V), and the cosine of the angle between the token X entering the
layer and each of Δ W^o and MH W^o. For variants other than belief/belief_star, Δ is what
belief-attention would have used. Tensor-parallel shards are summed; pipeline stages
report their own layers and the results are gathered on every rank, from data-parallel
rank 0's micro-batch (each data-parallel rank measures its own). The same forward pass
measures each layer's FORWARD signals (belief_lm/train/layer_signals.py): its largest
pre-softmax attention score and the RMS of its output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.runtime.zero import GatheredParameters

from belief_lm.attention import global_orthogonal_residual
from belief_lm.model.attention_layer import CAPTURE
from belief_lm.model.gpt import DecoderLayer
from belief_lm.parallel.collectives import TensorParallelPlace, data_parallel_rank
from belief_lm.train import layer_signals


@torch.no_grad()
def belief_diagnostics(engine, tokens: torch.Tensor, labels: torch.Tensor, pipelined: bool) -> dict:
    """{'layer{n}/delta_over_mh': ..., 'layer{n}/cos_delta_wo_x': ..., 'layer{n}/cos_mh_wo_x',
    'layer{n}/max_logit', 'layer{n}/output_rms'} from one forward pass over (tokens,
    labels). Collective: every rank must call it."""
    layers = [m for m in engine.module.modules() if isinstance(m, DecoderLayer)]
    inputs: dict[int, torch.Tensor] = {}
    output_rms: dict[int, float] = {}

    def keep_input(module, args):
        inputs[module.layer_number] = _whole_sequence(module, _hidden(args[0]))

    def keep_output(module, args, output):
        whole = _whole_sequence(module, _hidden(output)).float()
        output_rms[module.layer_number] = float(whole.square().mean().sqrt())

    hooks = [layer.register_forward_pre_hook(keep_input) for layer in layers]
    hooks += [layer.register_forward_hook(keep_output) for layer in layers]
    captured: dict[int, dict] = {}  # layer number: its MH and V
    scope = CAPTURE.set(captured)
    was_training = engine.module.training
    engine.module.eval()
    try:
        if pipelined:
            engine.eval_batch(iter([(tokens, labels)]), num_micro_batches=1)
        else:
            engine.module(tokens)
    finally:
        engine.module.train(was_training)
        CAPTURE.reset(scope)
        for hook in hooks:
            hook.remove()
    results = {}
    for layer in layers:
        number = layer.layer_number
        mine = captured[number]
        results.update(_layer_stats(layer, inputs[number], mine["mh"], mine["v"]))
        results[f"layer{number}/max_logit"] = float(mine["max_logit"])
        results[f"layer{number}/output_rms"] = output_rms[number]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (data_parallel_rank(), results))
    # data-parallel ranks measured different micro-batches: every number is data-parallel
    # rank 0's (its tensor and pipeline peers'), not one rank's for some and another's for
    # the rest
    return layer_signals.merge([part for data_rank, part in gathered if data_rank == 0])


def _hidden(value: torch.Tensor | tuple) -> torch.Tensor:
    """The hidden states of what a layer takes or returns ((hidden, document ends) under
    model.attention_mask=document)."""
    return (value[0] if isinstance(value, tuple) else value).detach()


def _whole_sequence(layer: DecoderLayer, hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` [seq, batch, hidden] of the whole sequence: under sequence parallelism a
    layer's input and output are this rank's [seq / TP, ...], gathered here over TP."""
    if not layer.config.sequence_parallel:
        return hidden
    place = TensorParallelPlace.here()
    parts = [torch.empty_like(hidden) for _ in range(place.size)]
    dist.all_gather(parts, hidden.contiguous(), group=place.group)
    return torch.cat(parts)


def _layer_stats(layer: DecoderLayer, x: torch.Tensor, mh: torch.Tensor, v: torch.Tensor) -> dict:
    attention = layer.self_attention
    shard_sum = attention.core_attention.shard_sum  # the layer's own tensor-parallel sum

    def tp_sum(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if shard_sum is None else shard_sum(tensor)

    delta = global_orthogonal_residual(mh, v, shard_sum)
    weight = attention.linear_proj.weight  # W^o, this rank's input columns
    # ZeRO-3 holds a 1/DP partition of it outside the forward pass (collective; a no-op for
    # a weight ZeRO does not partition)
    with GatheredParameters([weight]):
        delta_wo, mh_wo = tp_sum(F.linear(delta, weight)), tp_sum(F.linear(mh, weight))
    squares = tp_sum(torch.stack([delta.float().square().sum(-1), mh.float().square().sum(-1)]))
    n = layer.layer_number
    return {
        f"layer{n}/delta_over_mh": float((squares[0] / squares[1]).sqrt().mean()),
        f"layer{n}/cos_delta_wo_x": float(F.cosine_similarity(delta_wo, x, dim=-1).mean()),
        f"layer{n}/cos_mh_wo_x": float(F.cosine_similarity(mh_wo, x, dim=-1).mean()),
    }
