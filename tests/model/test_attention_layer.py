"""FamilyCoreAttention against a literal per-head, per-token float64 reference."""

import math

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from belief_lm.model.attention_layer import FamilyCoreAttention
from belief_lm.variants import VARIANTS

S, B, HEADS, GROUPS, D = 10, 2, 4, 2, 8
SCALES = [1, 2, 3, 1]


def make(variant, gamma=0.6, beta=0.8):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * D,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        use_cpu_initialization=True,
    )
    return FamilyCoreAttention(
        config,
        layer_number=1,
        attn_mask_type=None,
        attention_type="self",
        variant=variant,
        gamma=gamma,
        beta=beta,
        head_scales=SCALES,
    )


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, HEADS, D, generator=g, dtype=torch.float64)
    k = torch.randn(S, B, GROUPS, D, generator=g, dtype=torch.float64)
    v = torch.randn(S, B, GROUPS, D, generator=g, dtype=torch.float64)
    return q, k, v


def reference(q, k, v, variant, gamma=0.6, beta=0.8):
    """Written from the papers' formulas, one head and one token at a time."""
    mixing, residual = VARIANTS[variant]
    h = torch.zeros_like(q)
    vh = torch.zeros_like(q)
    for m in range(HEADS):
        group = m // (HEADS // GROUPS)  # GQA: heads of group g are contiguous
        scale = SCALES[m] if mixing in ("sh", "bn_sh") else 1
        for b in range(B):
            keys, values = k[:, b, group], v[:, b, group]
            ends = list(range(0, S, scale))  # slot j averages positions end-scale+1..end
            slot_k = torch.stack([keys[max(0, e - scale + 1) : e + 1].mean(0) for e in ends])
            slot_v = torch.stack([values[max(0, e - scale + 1) : e + 1].mean(0) for e in ends])
            for i in range(S):
                visible = [j for j, e in enumerate(ends) if e <= i]
                ks, vs = slot_k[visible], slot_v[visible]
                mu = ks.mean(0) if mixing in ("bn", "bn_sh") else torch.zeros(D, dtype=q.dtype)
                scores = ((q[i, b, m] - beta * mu) * (ks - beta * mu)).sum(-1) / math.sqrt(D)
                h[i, b, m] = scores.softmax(0) @ vs
                vh[i, b, m] = values[i]
    if residual == "mh":
        return h.flatten(2)
    if residual == "attentionx":
        return (gamma * vh - h).flatten(2)
    mh, vv = h.flatten(2), vh.flatten(2)
    delta = mh - ((mh * vv).sum(-1) / (vv * vv).sum(-1)).unsqueeze(-1) * vv
    if residual == "belief":
        return delta
    delta_s = h - ((h * vh).sum(-1) / (vh * vh).sum(-1)).unsqueeze(-1) * vh
    return torch.cat((delta, delta_s.flatten(2)), -1)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference(variant):
    q, k, v = qkv()
    out = make(variant)(q, k, v, attention_mask=None)
    width = 2 if variant == "belief_star" else 1
    assert out.shape == (S, B, width * HEADS * D)
    torch.testing.assert_close(out, reference(q, k, v, variant), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("variant", ["belief", "belief_star"])
def test_first_position_residual_is_zero(variant):
    """At position 0 each head attends only to itself, H_0 = V_0, so Δ_0 = 0."""
    q, k, v = qkv(1)
    out = make(variant)(q, k, v, attention_mask=None)
    assert out[0].abs().max() < 1e-12
    assert out[1:].abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_future_tokens_do_not_matter(variant):
    q, k, v = qkv(2)
    t = 5
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[t + 1 :] = torch.randn_like(x[t + 1 :])
    attn = make(variant)
    a, b = attn(q, k, v, attention_mask=None), attn(q2, k2, v2, attention_mask=None)
    torch.testing.assert_close(a[: t + 1], b[: t + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(a[t + 1 :], b[t + 1 :])


def test_masks_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="takes no mask tensor"):
        make("softmax")(q, k, v, attention_mask=torch.ones(1, 1, S, S, dtype=torch.bool))
