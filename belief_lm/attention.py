"""The math of the belief-attention family, as plain tensor functions.

Everything a newcomer needs to check against the papers is here; the megatron-core wiring
(which tensors go in, tensor parallelism) lives in `belief_lm/model/attention_layer.py`.

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

`attention_heads` and `residual_signal` put these together into a whole attention layer's
core (Q, K, V in; the signal for the output projection out). They are also what the
Hugging Face export ships (this file needs only torch), so both compute the same thing.
`DecodeCache` (at the end) is what decoding keeps between steps, for every variant: the
same math, fed a few tokens at a time.

Documents (model.attention_mask=document): a window packs several documents, each ended
by an EOS; given `Documents` (where each token's document starts), a token attends only to
earlier tokens of its own document, and every running statistic restarts with it: μ is
the mean of the keys of the query's document up to it, Attention-SH's slots are counted
from the document's first token (slot b averages document positions b*s-s+1 .. b*s), and
positions (RoPE) restart at 0. Each document then computes exactly what it computes alone.

All projections are per token: coefficients never mix positions. Inner products are
accumulated in fp32 whatever the input dtype. If <V_i, V_i> = 0 then V_i = 0 and <MH_i, V_i> = 0,
so the coefficient is defined as 0 and Δ_i = MH_i (the projection onto the zero vector is
zero); gradients stay finite.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
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


def projection_steps(fused: bool) -> tuple[Callable, Callable]:
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
    inner_products, remove_component = projection_steps(fused)
    dots = inner_products(mh, v)
    if shard_sum is not None:
        dots = shard_sum(dots)
    return remove_component(mh, v, dots)


def per_head_orthogonal_residual(h: Tensor, v: Tensor, fused: bool = False) -> Tensor:
    """Belief-attention*'s Δ^s_m = H_m - (<H_m, V_m> / <V_m, V_m>) V_m, per token and head.

    `h` and `v` have shape [..., heads, head_dim]; with GQA pass each head's group value.
    """
    inner_products, remove_component = projection_steps(fused)
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


def heads_from_groups(kv: Tensor, heads: int, dim: int = 1) -> Tensor:
    """Repeat KV groups along `dim` so each of `heads` query heads has its own copy
    (megatron and SDPA's GQA order: query heads g*r .. g*r+r-1 share group g)."""
    repeats = heads // kv.shape[dim]
    return kv if repeats == 1 else kv.repeat_interleave(repeats, dim=dim)


def attention_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mixing: str,
    *,
    beta: float = 1.0,
    head_scales: Sequence[int] = (),
    softmax_scale: float | None = None,
    cache: LayerCache | None = None,
    step: DecodeStep | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """Causal H for queries [b, heads, s, d] and keys/values [b, groups, s, d].

    `mixing` is VARIANTS' first entry (belief_lm/variants.py): plain softmax, Attention-BN
    (queries recentred by the mean of the keys each may see), Attention-SH (head m attends
    to keys/values pooled by `head_scales[m]`) or both. Softmax runs in torch SDPA (flash
    kernels on GPU). With `documents`, each document of a row on its own (see the module's
    docstring; `_attend_documents`). With a `cache` (decoding), k and v are added to it at
    `step`'s positions and the queries attend to everything it holds (`cached_heads`); the
    first step of an unpadded batch is the whole sequence, computed as without a cache.
    """
    if cache is not None:
        cache.append(k, v, step)
        if not step.fresh:
            return cached_heads(q, cache, step, mixing, beta, head_scales, softmax_scale)
    if mixing not in ("sh", "bn_sh"):
        return _attend(q, k, v, mixing, beta, 1, softmax_scale, documents)
    heads = q.shape[1]
    k, v = heads_from_groups(k, heads), heads_from_groups(v, heads)
    out = torch.empty_like(q)
    for scale in sorted(set(head_scales)):  # each group of heads sharing a scale at once
        idx = [i for i, s in enumerate(head_scales) if s == scale]
        parts = (q[:, idx], k[:, idx], v[:, idx])
        out[:, idx] = _attend(*parts, mixing, beta, scale, softmax_scale, documents)
    return out


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mixing: str,
    beta: float,
    scale: int,
    softmax_scale: float | None,
    documents: Documents | None = None,
) -> Tensor:
    """softmax(q k^T) v for [b, heads, s, d] tensors, keys pooled by `scale`."""
    if documents is not None:
        return _attend_documents(q, k, v, mixing, beta, scale, softmax_scale, documents)
    seq_len = q.shape[2]
    if scale > 1:
        k, v = causal_pool(k, scale, dim=2), causal_pool(v, scale, dim=2)
    if mixing in ("bn", "bn_sh"):
        mean = causal_mean(k, dim=2)  # over slots/keys 0..b
        if scale > 1:
            mean = mean[:, :, torch.arange(seq_len, device=q.device) // scale]
        q = recentred_queries(q, heads_from_groups(mean, q.shape[1]), beta)
    if scale == 1:
        return _sdpa(q, k, v, is_causal=True, scale=softmax_scale)
    return _attend_pooled(q, k, v, scale, softmax_scale)


def max_logit(
    q: Tensor,
    k: Tensor,
    mixing: str,
    *,
    beta: float = 1.0,
    head_scales: Sequence[int] = (),
    softmax_scale: float | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """The largest pre-softmax score of `attention_heads` (queries [b, heads, s, d], keys
    [b, groups, s, d]) over every head, query and key (or pooled slot) it may see, as the
    variant defines it: q·k scaled (softmax), (q_i - βμ_i)·(k_j - βμ_i) scaled (Attention-BN,
    eq. 26, μ_i the mean of the keys query i sees), against the keys pooled by each head's
    scale (Attention-SH); with `documents`, only within each query's document (its keys,
    mean and slots restarting there, as `_attend_documents`). Materializes a [s, s] score
    matrix per head: for diagnostics."""
    heads, seq_len = q.shape[1], q.shape[2]
    scales = list(head_scales) if mixing in ("sh", "bn_sh") else [1] * heads
    k = heads_from_groups(k, heads)
    factor = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    positions = torch.arange(seq_len, device=q.device)
    largest = []
    for scale in sorted(set(scales)):
        idx = [i for i, s in enumerate(scales) if s == scale]
        queries = _wide(q[:, idx])
        if documents is None:
            keys = _wide(causal_pool(k[:, idx], scale, dim=2))
            slots = torch.arange(keys.shape[2], device=q.device)
            visible = slots[None, :] * scale <= positions[:, None]
        else:  # one slot per token, those that complete a slot seen (document_pool)
            keys = _wide(document_pool(k[:, idx], scale, documents) if scale > 1 else k[:, idx])
            slot_ends = documents.positions % scale == 0 if scale > 1 else None
            visible = visible_keys(documents.starts, slot_ends)[:, None]
        shift = 0.0
        if mixing in ("bn", "bn_sh"):  # (q_i - βμ_i)·k_j - β(q_i - βμ_i)·μ_i
            if documents is None:
                mean = causal_mean(keys, dim=2)[:, :, positions // scale]  # μ_i
            else:
                mean = document_mean(keys, scale, documents)
            queries = recentred_queries(queries, mean, beta)
            shift = beta * (queries * mean).sum(-1, keepdim=True)
        scores = queries @ keys.transpose(-1, -2) - shift
        largest.append((scores * factor).masked_fill(~visible, float("-inf")).amax())
    return torch.stack(largest).amax()


_CPU_FLASH_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.9"
"""The CPU flash kernel takes enable_gqa (pytorch/pytorch#157893); before, math runs it."""


def _sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, **options) -> Tensor:
    """torch SDPA for queries [b, heads, s, d] and keys/values [b, groups, s', d], their
    groups shared by heads as GQA: natively (enable_gqa) where the flash kernel takes it,
    otherwise with each group repeated per head. enable_gqa elsewhere sends the call to the
    math kernel (a [s, s'] score matrix per head): flash takes GQA on CUDA in half
    precision, on the CPU from torch 2.9, and never with a mask."""
    if k.shape[1] != q.shape[1]:
        native = q.dtype in (torch.float16, torch.bfloat16) if q.is_cuda else _CPU_FLASH_GQA
        if attn_mask is None and native:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)
        k, v = heads_from_groups(k, q.shape[1]), heads_from_groups(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)


def _attend_pooled(q: Tensor, k: Tensor, v: Tensor, scale: int, softmax_scale) -> Tensor:
    """Attention-SH's pooled attention as plain causal attention, so that it runs in SDPA's
    flash kernel: with a [seq, slots] mask (query i sees slot b where b*scale <= i) SDPA
    falls back to its math or efficient kernel.

    Query i = g*scale + o (group g, offset o < scale) sees slots 0..g: the same slots for
    every query of group g, and there are as many groups as slots. Each offset o is made a
    head of its own over the groups, with its head's keys: then query (o, g) sees keys
    0..g, which is exactly is_causal over the ceil(s/scale) groups. The keys are copied per
    offset (as many elements as the unpooled keys) rather than shared as GQA groups: not
    every flash kernel takes GQA (the CPU one falls back to math)."""
    b, heads, seq_len, d = q.shape
    groups = k.shape[2]
    q = F.pad(q, (0, 0, 0, groups * scale - seq_len))  # the last group's missing offsets
    q = q.view(b, heads, groups, scale, d).transpose(2, 3).reshape(b, heads * scale, groups, d)
    k, v = heads_from_groups(k, heads * scale), heads_from_groups(v, heads * scale)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale)
    out = out.view(b, heads, scale, groups, d).transpose(2, 3).reshape(b, heads, -1, d)
    return out[:, :, :seq_len]


class Documents(NamedTuple):
    """Where each token's document starts in its row: what attention needs to keep the
    documents packed into a window apart (`documents` derives it from the EOS marks)."""

    starts: Tensor
    """[b, s] the index of the first token of each token's document (int64)."""
    positions: Tensor
    """[b, s] each token's position in its document: 0 at its first token."""


def documents(ends: Tensor) -> Documents:
    """The documents of rows [b, s] whose `ends` is True at each document's last token (an
    EOS): a document starts at the row's first token (one that began in an earlier window
    starts there) and after every EOS (so an EOS right after another is a document alone)."""
    index = torch.arange(ends.shape[-1], device=ends.device)
    begins = torch.cat((torch.ones_like(ends[..., :1]), ends[..., :-1]), dim=-1)
    starts = torch.where(begins, index, 0).cummax(-1).values
    return Documents(starts, index - starts)


def _sums_since(x: Tensor, first: Tensor) -> Tensor:
    """For x [b, g, s, d] and first [b, s] (each <= its token's index): the sums of x over
    tokens first[i] .. i, in float64, as differences of float64 prefix sums (a sum that
    starts late in a long row keeps its precision)."""
    prefix = F.pad(x.double().cumsum(2), (0, 0, 1, 0))
    index = first[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return prefix[:, :, 1:] - prefix.gather(2, index)


def document_pool(x: Tensor, scale: int, docs: Documents) -> Tensor:
    """Attention-SH's slots within documents, kept at the token that completes them: token
    t of x [b, g, s, d] becomes the mean of its document's tokens max(start, t-scale+1) ..
    t, which is slot b of its document where t is its document position b*scale (a partial
    window elsewhere, which no query sees; see `_attend_documents`)."""
    index = torch.arange(x.shape[2], device=x.device)
    first = torch.maximum(docs.starts, index - scale + 1)
    count = (index - first + 1)[:, None, :, None]
    return (_sums_since(x, first) / count).to(x.dtype)


def document_mean(x: Tensor, scale: int, docs: Documents) -> Tensor:
    """Attention-BN's μ within documents: for each token, the mean of the slots (tokens at
    scale 1) of its document that it sees, those at document positions 0, scale, 2*scale,
    ... up to its own; x [b, g, s, d] holds a slot at the token that completes it."""
    slot_ends = (docs.positions % scale == 0)[:, None, :, None]
    count = (docs.positions // scale + 1)[:, None, :, None]
    return (_sums_since(x * slot_ends, docs.starts) / count).to(x.dtype)


def visible_keys(starts: Tensor, slot_ends: Tensor | None = None) -> Tensor:
    """[b, s, s]: query i sees key j iff starts[b, i] <= j <= i (its own document, up to
    it), and, given `slot_ends` [b, s], only keys where a slot ends."""
    index = torch.arange(starts.shape[-1], device=starts.device)
    visible = (index <= index[:, None]) & (index >= starts[..., None])
    return visible if slot_ends is None else visible & slot_ends[:, None, :]


def _attend_documents(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mixing: str,
    beta: float,
    scale: int,
    softmax_scale: float | None,
    docs: Documents,
) -> Tensor:
    """_attend with each document of a row on its own, by document_kernel's kernel: the
    keys a query sees, their mean (Attention-BN) and their slots (Attention-SH) restart at
    its document's first token."""
    if document_kernel(q.device) == "bins":
        return documents_in_bins(q, k, v, mixing, beta, scale, softmax_scale, docs)
    if scale > 1:  # the slots stay one per token, those that complete a slot seen
        k, v = document_pool(k, scale, docs), document_pool(v, scale, docs)
    if mixing in ("bn", "bn_sh"):
        mean = document_mean(k, scale, docs)
        q = recentred_queries(q, heads_from_groups(mean, q.shape[1]), beta)
    slot_ends = docs.positions % scale == 0 if scale > 1 else None
    return document_softmax(q, k, v, docs.starts, slot_ends, softmax_scale)


DOCUMENT_KERNELS = ("flex", "bins", "dense")
"""How attention within documents can run:
- bins: every document of the batch alone, through the causal path (`_attend`), documents
  of similar length padded to a common length (`bin_widths`) and computed together, one
  causal SDPA (flash) call per length: each document's own work, a little more for
  padding; the calls sized on the host (a host sync);
- flex: FlexAttention with a block mask (the blocks no query of a block sees skipped),
  compiled (Triton on CUDA), on the keys and slots the masked math prepares
  (document_pool, document_mean);
- dense: SDPA with the whole [b, s, s] boolean mask over the same, every block computed
  (twice causal attention's work). On the CPU SDPA's flash kernel takes a mask; on CUDA a
  mask sends SDPA to its efficient or math kernel."""

MIN_BIN = 16
"""The shortest padded length of the bins kernel: shorter documents share its call."""


def document_kernel(device: torch.device) -> str:
    """The kernel of DOCUMENT_KERNELS that runs on `device`: flex on CUDA; on the CPU bins
    (FlexAttention has no backward there), or dense inside torch.compile (bins sizes its
    calls on the host: data-dependent shapes would break the graph at every layer).
    Measured in bench/document_mask.py."""
    if device.type == "cuda":
        return "flex"
    return "dense" if torch.compiler.is_compiling() else "bins"


def documents_in_bins(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mixing: str,
    beta: float,
    scale: int,
    softmax_scale: float | None,
    docs: Documents,
) -> Tensor:
    """The bins kernel (DOCUMENT_KERNELS): every document of the batch through `_attend`
    alone, padded after its last token (where causal attention, the running key mean and
    the pooled slots a real token sees cannot reach), documents of one padded length in one
    call. The tokens are gathered into the bins, and the results back, by one index_select
    each (whose backward is one index_add)."""
    b, heads, seq_len, d = q.shape
    flat = [x.transpose(1, 2).reshape(b * seq_len, x.shape[1], d) for x in (q, k, v)]
    starts = torch.nonzero(docs.positions.flatten() == 0).flatten()
    lengths = torch.diff(starts, append=starts.new_tensor([b * seq_len]))
    widths = bin_widths(lengths)
    bins = widths.unique().tolist()  # host sync: the calls' sizes
    gather, real = [], []
    for width in bins:
        offsets = torch.arange(width, device=q.device)
        chosen = widths == width
        gather.append((starts[chosen, None] + offsets).clamp_max(b * seq_len - 1).flatten())
        real.append((offsets < lengths[chosen, None]).flatten())
    gather, real = torch.cat(gather), torch.cat(real)
    binned = [x.index_select(0, gather) for x in flat]
    sizes = [int(n) * w for n, w in zip(torch.bincount(widths)[bins].tolist(), bins, strict=True)]
    outputs = []
    for width, *parts in zip(bins, *(x.split(sizes) for x in binned), strict=True):
        q_bin, k_bin, v_bin = (x.view(-1, width, *x.shape[1:]).transpose(1, 2) for x in parts)
        h = _attend(q_bin, k_bin, v_bin, mixing, beta, scale, softmax_scale)
        outputs.append(h.transpose(1, 2).reshape(-1, heads, d))
    rows = torch.nonzero(real).flatten()  # the real tokens' rows among the bins' outputs
    source = torch.empty_like(rows).index_copy_(0, gather[rows], rows)  # token -> its row
    out = torch.cat(outputs).index_select(0, source)
    return out.view(b, seq_len, heads, d).transpose(1, 2)


def bin_widths(lengths: Tensor) -> Tensor:
    """The padded length of documents of `lengths` in the bins kernel: at least MIN_BIN,
    rounded up to the next 2^n or 1.5 x 2^n (at most 1.5 x the length: about 2.25 x its
    attention's work, 1.25 x on average)."""
    lengths = lengths.clamp_min(MIN_BIN)
    power = lengths.double().log2().floor().exp2().long()  # 2^n <= length
    half = power + power // 2
    return torch.where(lengths <= power, power, torch.where(lengths <= half, half, 2 * power))


def document_softmax(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    starts: Tensor,
    slot_ends: Tensor | None,
    softmax_scale: float | None,
    kernel: str | None = None,
) -> Tensor:
    """softmax(q k^T) v for queries [b, heads, s, d] and keys/values [b, groups, s, d]
    where query i sees key j iff starts[b, i] <= j <= i (and slot_ends[b, j], if given);
    `kernel` flex or dense (default: flex on CUDA, see DOCUMENT_KERNELS)."""
    kernel = kernel or ("flex" if document_kernel(q.device) == "flex" else "dense")
    if kernel == "dense":
        mask = visible_keys(starts, slot_ends).unsqueeze(1)
        return _sdpa(q, k, v, attn_mask=mask, scale=softmax_scale)

    def visible(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        seen = (j <= i) & (j >= starts[b, i])
        return seen if slot_ends is None else seen & slot_ends[b, j]

    # imported here: the Hugging Face export ships this file, and may meet a torch without it
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows, _, seq_len, _ = q.shape
    # compiled on CUDA: the block mask without a [b, s, s] mask in memory, and fused kernels
    # (eager, elsewhere, flex is the reference the tests hold the dense mask to)
    make_mask = _compiled(create_block_mask) if q.is_cuda else create_block_mask
    block_mask = make_mask(visible, rows, None, seq_len, seq_len, device=q.device)
    attend = _compiled(flex_attention) if q.is_cuda else flex_attention
    gqa = k.shape[1] != q.shape[1]
    return attend(q, k, v, block_mask=block_mask, scale=softmax_scale, enable_gqa=gqa)


def residual_signal(
    h: Tensor,
    v_heads: Tensor,
    residual: str,
    gamma: float = 0.5,
    shard_sum: ShardSum | None = None,
    fused: bool = False,
) -> Tensor:
    """What the output projection receives, from H and each head's V ([..., heads, d]):
    MH, AttentionX's Φ, belief's Δ, or belief_star's [Δ, Δ^s] ([..., heads * d], twice
    that for belief_star). `residual` is VARIANTS' second entry; `fused` compiles the
    projections (see _steps)."""
    if residual == "mh":
        return h.flatten(-2)
    if residual == "attentionx":
        return consensus_discrepancy(h, v_heads, gamma).flatten(-2)
    delta = global_orthogonal_residual(h.flatten(-2), v_heads.flatten(-2), shard_sum, fused)
    if residual == "belief":
        return delta
    return torch.cat((delta, per_head_orthogonal_residual(h, v_heads, fused).flatten(-2)), -1)


# Decoding with a cache. Each step feeds n new tokens per row (the prompt, then one at a
# time). Keys and values are kept as the slots the heads attend to, per Attention-SH scale
# s (s = 1 for every head of the other variants: a slot is then one token): slot b
# averages positions b*s-s+1 .. b*s (causal_pool) and is summed as its tokens arrive, so
# the last slot may be partial; query i sees slot b once it is complete (b*s <= i).
# Attention-BN's μ_i is the mean of the slots query i sees, taken from the cache: it needs
# no state of its own. belief, belief_star and AttentionX project per token, on the
# current token's V alone. A row's positions count its real tokens only: padding
# (`valid` False) takes no slot and is seen by no query, so a left-padded row of a batch
# computes what it computes alone. With documents a row's cache holds its current document
# alone (DecodeCache.steps): after an EOS its slots are emptied and positions restart.


def rotary_angles(positions: Tensor, dim: int, base: float) -> Tensor:
    """RoPE angles [*positions.shape, dim] in the non-interleaved layout (megatron's: the
    same frequencies for both halves of a head)."""
    inv_freq = 1.0 / base ** (
        torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
    )
    angles = positions.float().unsqueeze(-1) * inv_freq
    return torch.cat((angles, angles), dim=-1)


class DecodeStep(NamedTuple):
    """Where a decoding step's new tokens sit: the same for every layer."""

    positions: Tensor
    """[b, n] each token's position among its row's real tokens (of its document, with
    documents; padding: clamped to 0)."""
    valid: Tensor
    """[b, n] False for padding."""
    last: int
    """The largest position: slots 0 .. last // s are complete for some row."""
    fresh: bool
    """Nothing was cached before and nothing is padding: the whole sequence is here."""


class LayerCache:
    """One attention layer's slots: per scale s, keys and values [b, groups, slots, d]
    holding the sums of k / (tokens in the slot), in the accumulation dtype for s > 1."""

    def __init__(self, scales: Sequence[int]):
        self.slots: dict[int, list[Tensor | None]] = {s: [None, None] for s in scales}

    def forget(self, rows: Tensor) -> None:
        """Empty the slots of `rows` ([b] bool): their next token starts a document."""
        for held in self.slots.values():
            for x in held:
                if x is not None:
                    x[rows] = 0

    def append(self, k: Tensor, v: Tensor, step: DecodeStep) -> None:
        """Add keys and values [b, groups, n, d] of the step's tokens to their slots."""
        valid = step.valid[:, None, :, None]
        for scale, held in self.slots.items():
            index = (step.positions + scale - 1) // scale  # ceil(p / s): p's slot
            size = torch.where(index == 0, 1, scale)[:, None, :, None]
            for i, x in enumerate((k, v)):
                part = torch.where(valid, (x if scale == 1 else _wide(x)) / size, 0)
                held[i] = _add_to_slots(held[i], part, index, -(-step.last // scale) + 1)


def _add_to_slots(slots: Tensor | None, values: Tensor, index: Tensor, needed: int) -> Tensor:
    """slots[:, :, index[b, j]] += values[:, :, j] for every row b, after growing the slot
    dimension (by doubling, so a long generation copies it only log(n) times)."""
    have = 0 if slots is None else slots.shape[2]
    if have < needed:
        b, groups, _, d = values.shape
        grown = values.new_zeros(b, groups, max(needed, 2 * have), d)
        if slots is not None:
            grown[:, :, :have] = slots
        slots = grown
    return slots.scatter_add_(2, index[:, None, :, None].expand_as(values), values)


def cached_heads(
    q: Tensor,
    cache: LayerCache,
    step: DecodeStep,
    mixing: str,
    beta: float,
    head_scales: Sequence[int],
    softmax_scale: float | None,
) -> Tensor:
    """H for the step's queries [b, heads, n, d] over the cached slots (see above)."""
    heads = q.shape[1]
    scales = head_scales if mixing in ("sh", "bn_sh") else [1] * heads
    out = torch.empty_like(q)
    for scale, (k, v) in cache.slots.items():
        idx = [i for i, s in enumerate(scales) if s == scale]
        used = step.last // scale + 1
        k, v = k[:, :, :used].to(q.dtype), v[:, :, :used].to(q.dtype)
        slot_ends = torch.arange(used, device=q.device) * scale
        visible = slot_ends <= step.positions.unsqueeze(-1)  # [b, n, slots]
        if len(idx) < heads:  # only some heads have this scale: give each its own copy
            k, v = heads_from_groups(k, heads)[:, idx], heads_from_groups(v, heads)[:, idx]
        q_s = q[:, idx]
        if mixing in ("bn", "bn_sh"):
            weights = visible / visible.sum(-1, keepdim=True)  # μ: the mean of visible slots
            mean = (weights.unsqueeze(1).to(_wide(k).dtype) @ _wide(k)).to(q.dtype)
            q_s = recentred_queries(q_s, heads_from_groups(mean, q_s.shape[1]), beta)
        out[:, idx] = _sdpa(q_s, k, v, attn_mask=visible.unsqueeze(1), scale=softmax_scale)
    return out


class DecodeCache:
    """What a whole model keeps between decoding steps: one LayerCache per layer, how many
    tokens each row has fed (real ones: its next position; all: `columns`) and, with
    documents, whether each row's last token ended its document.

    With documents (model.attention_mask=document), a row's cache holds its current
    document only: the token after an EOS starts a new one, so the row forgets its slots
    and its positions restart at 0. `steps` feeds tokens that hold EOS in runs, each
    continuing or starting every row's document."""

    def __init__(self, num_layers: int, mixing: str, head_scales: Sequence[int]):
        scales = sorted(set(head_scales)) if mixing in ("sh", "bn_sh") else [1]
        self.layers = [LayerCache(scales) for _ in range(num_layers)]
        self.seen: Tensor | None = None
        """[b] real tokens fed so far, per row (of its current document, with documents)."""
        self.columns = 0
        """Tokens fed so far per row, padding included."""
        self.ended: Tensor | None = None
        """[b] with documents: whether the row's last real token fed ended a document."""

    def step(self, valid: Tensor, ends: Tensor | None = None) -> DecodeStep:
        """The positions of the next tokens, `valid` [b, n] (False: padding), which are
        then counted as fed. With documents, `ends` [b, n] is True at each EOS; a row's
        EOS must be its last token of the step (`steps` splits tokens so), and a row whose
        previous step ended with one starts a new document here."""
        if self.ended is not None and bool(self.ended.any()):  # host sync
            for layer in self.layers:
                layer.forget(self.ended)
            self.seen = torch.where(self.ended, 0, self.seen)
        counted = valid.long().cumsum(-1)
        if self.seen is not None:
            counted = counted + self.seen.unsqueeze(-1)
        positions = (counted - 1).clamp_min(0)
        # host syncs, once per step for all layers: how many slots are in use; whether
        # the full-sequence path applies
        fresh = self.seen is None and bool(valid.all())
        if ends is not None:  # the row's last real token here, if it has one, is an EOS
            index = torch.arange(valid.shape[1], device=valid.device)
            last = torch.where(valid, index, -1).amax(-1)
            ended = ends.gather(-1, last.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            previous = self.ended if self.ended is not None else torch.zeros_like(ended)
            self.ended = torch.where(last >= 0, ended, previous)
        self.seen, self.columns = counted[:, -1], self.columns + valid.shape[1]
        return DecodeStep(positions, valid, int(positions.max()), fresh)

    def steps(
        self, valid: Tensor, ends: Tensor | None = None
    ) -> Iterator[tuple[slice, DecodeStep]]:
        """Feed tokens [b, n] (`valid`: not padding; `ends`: True at each EOS, with
        documents, else None) as one step, or with documents as one step per run of
        columns that ends where some row's document ends: yields each run's columns and
        its step, taken once the caller has fed the run before it to every layer."""
        runs = [slice(None)]
        if ends is not None:
            ends = ends & valid
            cuts = (ends.any(0).nonzero().flatten() + 1).tolist()  # host sync
            bounds = [0, *(c for c in cuts if c < valid.shape[1]), valid.shape[1]]
            runs = [slice(a, b) for a, b in itertools.pairwise(bounds)]
        for run in runs:
            yield run, self.step(valid[:, run], None if ends is None else ends[:, run])
