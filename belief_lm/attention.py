"""The math of the belief-attention family, as plain tensor functions.

Everything a newcomer needs to check against the papers is here; the megatron-core wiring
(which tensors go in, tensor parallelism) lives in `belief_lm/model/attention.py`.

Notation (per layer, per token i): H_m = softmax(Q_m K_m^T / sqrt(d)) V_m for head m,
MH = concat_m H_m, V = concat_m V_m (with GQA, V_m is the value of head m's KV group).

- belief (BeliefFormer eq. 10-14): Δ_i = MH_i - (<MH_i, V_i> / <V_i, V_i>) V_i over the whole
  concatenated row; X += Δ W^o.
- belief_star (eq. 15-17): also Δ^s_m,i = H_m,i - (<H_m,i, V_m,i> / <V_m,i, V_m,i>) V_m,i per
  head; X += Δ W^o + Δ^s W^s.
- attentionx (AttentionX eq. 9-10): Φ_m = γ V_m - H_m; X += concat_m(Φ_m) W^o.
- attention_bn (primal-dual eq. 26): scores (q_i - βμ)·(k_j - βμ) / sqrt(d), where μ is the
  mean of the keys query i may see (j <= i: a full-sequence mean would leak the future).
- attention_sh (eq. 25): head m attends to keys/values average-pooled by its scale s_m;
  the pooled slot b averages tokens b*s-s+1 .. b*s, so a query at i sees only slots with
  b*s <= i (slot 0 is token 0 alone, so every query sees at least one slot).

All projections are per token: coefficients never mix positions. Inner products are
accumulated in fp32 whatever the input dtype. If <V_i, V_i> = 0 then V_i = 0 and <MH_i, V_i> = 0,
so the coefficient is defined as 0 and Δ_i = MH_i (the projection onto the zero vector is
zero); gradients stay finite.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

ShardSum = Callable[[Tensor], Tensor]
"""Sums a tensor over the tensor-parallel ranks that hold the other heads (identity at TP=1).
Its backward must also be a sum over ranks: every rank's output depends on the total."""


def _wide(x: Tensor) -> Tensor:
    """x in the accumulation dtype: fp32, or x's own dtype if wider (fp64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _inner_products(x: Tensor, v: Tensor) -> Tensor:
    """[..., 2]: <x, v> and <v, v> over the last dimension, in the accumulation dtype."""
    x, v = _wide(x), _wide(v)
    return torch.stack(((x * v).sum(-1), (v * v).sum(-1)), dim=-1)


def _remove_component(x: Tensor, v: Tensor, dots: Tensor) -> Tensor:
    """x - (x·v / v·v) v from the inner products `dots`, computed in the accumulation
    dtype and returned in x's; the coefficient is 0 where v·v = 0 (then x·v = 0 too)."""
    coefficient = dots[..., 0] / dots[..., 1].clamp_min(torch.finfo(dots.dtype).tiny)
    return (_wide(x) - coefficient.unsqueeze(-1) * _wide(v)).to(x.dtype)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def _steps(fused: bool) -> tuple[Callable, Callable]:
    """The two steps, plain or compiled. Compiled (torch.compile / Inductor), each is one
    kernel instead of a chain of elementwise ops and reductions over the activations: the
    same math, faster where memory bandwidth is the limit. The plain path is the reference
    the tests hold the compiled one to."""
    if fused:
        return _compiled(_inner_products), _compiled(_remove_component)
    return _inner_products, _remove_component


def global_orthogonal_residual(
    mh: Tensor, v: Tensor, shard_sum: ShardSum | None = None, fused: bool = False
) -> Tensor:
    """Belief-attention's Δ = MH - (<MH, V> / <V, V>) V, per token.

    `mh` and `v` have the same shape [..., features] whose last dimension is all heads
    concatenated. Under tensor parallelism it holds only this rank's heads and `shard_sum`
    adds the other ranks' partial inner products (one all-reduce of a [..., 2] tensor).
    """
    inner_products, remove_component = _steps(fused)
    dots = inner_products(mh, v)
    if shard_sum is not None:
        dots = shard_sum(dots)
    return remove_component(mh, v, dots)


def per_head_orthogonal_residual(h: Tensor, v: Tensor, fused: bool = False) -> Tensor:
    """Belief-attention*'s Δ^s_m = H_m - (<H_m, V_m> / <V_m, V_m>) V_m, per token and head.

    `h` and `v` have shape [..., heads, head_dim]; with GQA pass each head's group value.
    """
    inner_products, remove_component = _steps(fused)
    return remove_component(h, v, inner_products(h, v))


def consensus_discrepancy(h: Tensor, v: Tensor, gamma: float) -> Tensor:
    """AttentionX's Φ = γ V - H (any shape; γ in (0, 1])."""
    return gamma * v - h


def causal_mean(x: Tensor, dim: int) -> Tensor:
    """Running mean along `dim`: out[i] = mean(x[0..i]), accumulated in (at least) fp32."""
    total = _wide(x).cumsum(dim)
    count = torch.arange(1, x.shape[dim] + 1, device=x.device, dtype=total.dtype)
    count = count.view([-1 if d == dim % x.dim() else 1 for d in range(x.dim())])
    return (total / count).to(x.dtype)


def recentred_queries(q: Tensor, visible_key_mean: Tensor, beta: float) -> Tensor:
    """Attention-BN as a query shift: for each query i with visible-key mean μ_i,

        (q_i - βμ_i)·(k_j - βμ_i) = (q_i - βμ_i)·k_j - β(q_i - βμ_i)·μ_i,

    and the last term is the same for every key j, so softmax over j ignores it: attending
    with q_i - βμ_i against the unchanged keys gives exactly eq. 26.
    """
    return q - beta * visible_key_mean


def causal_pool(x: Tensor, scale: int, dim: int) -> Tensor:
    """Average-pool along `dim` into slots b = 0, 1, ...; slot b averages positions
    max(0, b*scale - scale + 1) .. b*scale, so it is complete once position b*scale is seen.
    Returns ceil(n / scale) slots (n = x.shape[dim]); scale 1 returns x unchanged."""
    if scale == 1:
        return x
    n = x.shape[dim]
    ends = torch.arange(0, n, scale, device=x.device)
    starts = (ends - scale + 1).clamp_min(0)
    prefix = torch.nn.functional.pad(_wide(x).movedim(dim, -1).cumsum(-1), (1, 0))
    sums = prefix[..., ends + 1] - prefix[..., starts]
    return (sums / (ends - starts + 1)).movedim(-1, dim).to(x.dtype)


def pooled_causal_mask(seq_len: int, scale: int, device: torch.device | None = None) -> Tensor:
    """Boolean [seq_len, slots] mask, True where query i may attend to pooled slot b
    (b*scale <= i): every position the slot averages is at or before i."""
    slot_ends = torch.arange(0, seq_len, scale, device=device)
    return slot_ends.unsqueeze(0) <= torch.arange(seq_len, device=device).unsqueeze(1)
