"""The projection math against direct float64 formulas, per token and per head."""

import itertools

import pytest
import torch

from belief_lm import attention as fam


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def direct_residual(x, v):
    """x - (<x,v>/<v,v>) v in float64, row by row."""
    x, v = x.double(), v.double()
    return x - ((x * v).sum(-1) / (v * v).sum(-1)).unsqueeze(-1) * v


def test_global_residual_matches_float64_formula():
    mh, v = rand(3, 7, 48, seed=1), rand(3, 7, 48, seed=2)
    delta = fam.global_orthogonal_residual(mh, v)
    assert delta.dtype == mh.dtype and delta.shape == mh.shape
    torch.testing.assert_close(delta.double(), direct_residual(mh, v), rtol=1e-5, atol=1e-5)


def test_per_head_residual_matches_float64_formula():
    h, v = rand(3, 7, 4, 12, seed=3), rand(3, 7, 4, 12, seed=4)
    delta = fam.per_head_orthogonal_residual(h, v)
    torch.testing.assert_close(delta.double(), direct_residual(h, v), rtol=1e-5, atol=1e-5)
    # per head is not the global projection of the concatenated row
    assert not torch.allclose(
        delta.flatten(-2), fam.global_orthogonal_residual(h.flatten(-2), v.flatten(-2))
    )


def test_bf16_inputs_accumulate_in_fp32():
    # MH nearly parallel to V (small Δ): where the coefficient's precision matters
    v = rand(2, 5, 768, seed=6).bfloat16()
    mh = (2 * v.float() + 0.05 * rand(2, 5, 768, seed=5)).bfloat16()
    delta = fam.global_orthogonal_residual(mh, v)
    assert delta.dtype == torch.bfloat16
    exact = direct_residual(mh, v)  # exact math on the same bf16 values
    ours = (delta.double() - exact).abs().max()
    # what accumulating the inner products in bf16 would give
    naive_alpha = (mh * v).sum(-1) / (v * v).sum(-1)
    naive = (mh - naive_alpha.unsqueeze(-1) * v).double()
    assert ours <= 2**-8 * exact.abs().max()  # one bf16 rounding of the output
    assert (naive - exact).abs().max() > 10 * ours


@pytest.mark.parametrize("fn", ["global", "per_head"])
def test_coefficient_is_per_token(fn):
    """Changing V at token j changes Δ at token j only."""
    h, v = rand(2, 9, 4, 8, seed=7), rand(2, 9, 4, 8, seed=8)
    run = {
        "global": lambda h, v: fam.global_orthogonal_residual(h.flatten(-2), v.flatten(-2)),
        "per_head": lambda h, v: fam.per_head_orthogonal_residual(h, v).flatten(-2),
    }[fn]
    before = run(h, v)
    v2 = v.clone()
    v2[1, 4] += rand(4, 8, seed=9)
    after = run(h, v2)
    changed = (before - after).abs().amax(-1) > 0
    expected = torch.zeros(2, 9, dtype=torch.bool)
    expected[1, 4] = True
    assert torch.equal(changed, expected)


def test_orthogonal_and_not_longer_per_token():
    mh, v = rand(4, 16, 64, seed=10), rand(4, 16, 64, seed=11)
    delta = fam.global_orthogonal_residual(mh, v)
    cos = (delta * v).sum(-1) / (delta.norm(dim=-1) * v.norm(dim=-1))
    assert cos.abs().max() < 1e-5
    assert (delta.norm(dim=-1) <= mh.norm(dim=-1) * (1 + 1e-6)).all()


def test_orthogonal_and_not_longer_per_head():
    h, v = rand(4, 16, 6, 16, seed=12), rand(4, 16, 6, 16, seed=13)
    delta = fam.per_head_orthogonal_residual(h, v)
    cos = (delta * v).sum(-1) / (delta.norm(dim=-1) * v.norm(dim=-1))
    assert cos.abs().max() < 1e-5
    assert (delta.norm(dim=-1) <= h.norm(dim=-1) * (1 + 1e-6)).all()


def test_zero_value_gives_mh_and_finite_gradients():
    """<V,V> = 0 means V = 0: the coefficient is 0, Δ = MH, gradients stay finite."""
    mh = rand(2, 3, 16, seed=14).requires_grad_()
    v = rand(2, 3, 16, seed=15)
    v[0, 1] = 0.0
    v.requires_grad_()
    for delta in (
        fam.global_orthogonal_residual(mh, v),
        fam.per_head_orthogonal_residual(mh.view(2, 3, 4, 4), v.view(2, 3, 4, 4)).flatten(-2),
    ):
        assert torch.equal(delta[0, 1], mh[0, 1])
        delta.square().sum().backward()
        assert torch.isfinite(mh.grad).all() and torch.isfinite(v.grad).all()
        mh.grad = v.grad = None


def test_shard_sum_reproduces_the_full_projection():
    """Heads split in two shards: each shard's Δ, with the partial inner products summed
    over shards, equals its slice of the unsharded Δ (what TP all-reduce provides)."""
    mh, v = rand(2, 5, 32, seed=16), rand(2, 5, 32, seed=17)
    full = fam.global_orthogonal_residual(mh, v)
    halves = [(mh[..., :16], v[..., :16]), (mh[..., 16:], v[..., 16:])]
    partials = [torch.stack(((m * u).sum(-1), (u * u).sum(-1)), dim=-1) for m, u in halves]
    total = partials[0] + partials[1]
    shards = [fam.global_orthogonal_residual(m, u, shard_sum=lambda _: total) for m, u in halves]
    torch.testing.assert_close(torch.cat(shards, -1), full)


def test_consensus_discrepancy_is_exact():
    h, v = rand(3, 4, 8, seed=18), rand(3, 4, 8, seed=19)
    assert torch.equal(fam.consensus_discrepancy(h, v, 0.5), 0.5 * v - h)


def test_causal_mean_is_a_running_mean():
    x = rand(2, 10, 3, seed=20)
    expected = torch.stack([x[:, : i + 1].mean(1) for i in range(10)], dim=1)
    torch.testing.assert_close(fam.causal_mean(x, dim=1), expected)


SCALES = [1, 2, 3, 4, 1, 4, 3, 2]  # 8 heads over 4 KV groups: groups mix scales


@pytest.mark.parametrize("scale", [1, 2, 3, 4])
def test_causal_pool_averages_the_slots_tokens(scale):
    n = 11
    x = rand(2, n, 5, seed=21)
    slots = []
    for end in range(0, n, scale):
        start = max(0, end - scale + 1)
        slots.append(x[:, start : end + 1].mean(1))
    torch.testing.assert_close(fam.causal_pool(x, scale, dim=1), torch.stack(slots, 1))


@pytest.mark.parametrize("seq_len", [1, 7, 12, 23])
@pytest.mark.parametrize("mixing", ["sh", "bn_sh"])
def test_pooled_heads_equal_the_masked_softmax(mixing, seq_len):
    """Attention-SH (run as causal attention over query groups, for SDPA's flash kernel)
    against eq. 25 written out: head m's scores against its pooled keys, masked where a
    slot ends after the query (b*s_m > i), in fp64; values and gradients, sequence lengths
    that are and are not multiples of the scales."""
    beta = 0.7 if mixing == "bn_sh" else 0.0
    q, k, v = (rand(2, h, seq_len, 8, dtype=torch.float64, seed=70 + i).requires_grad_()
               for i, h in enumerate((8, 4, 4)))  # fmt: skip
    out = fam.attention_heads(q, k, v, mixing, beta=beta, head_scales=SCALES)
    heads = []
    for m, scale in enumerate(SCALES):
        keys, values = (fam.causal_pool(x[:, m // 2], scale, dim=1) for x in (k, v))
        slot_ends = torch.arange(0, seq_len, scale)
        visible = slot_ends <= torch.arange(seq_len).unsqueeze(1)  # [query, slot]
        mean = (visible / visible.sum(-1, keepdim=True)).double() @ keys  # μ_i: visible slots
        query = q[:, m] - beta * mean
        scores = (query @ keys.transpose(1, 2)) / 8**0.5
        heads.append(scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values)
    literal = torch.stack(heads, 1)
    torch.testing.assert_close(out, literal)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(literal.square().sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_recentred_queries_equal_eq26_scores():
    """softmax over j of (q_i - βμ_i)·k_j equals softmax of (q_i - βμ_i)·(k_j - βμ_i)."""
    q, k = rand(6, 8, dtype=torch.float64, seed=22), rand(6, 8, dtype=torch.float64, seed=23)
    beta = 0.7
    mu = fam.causal_mean(k, dim=0)
    shifted = fam.recentred_queries(q, mu, beta) @ k.T
    literal = torch.stack([(q[i] - beta * mu[i]) @ (k - beta * mu[i]).T for i in range(6)])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    p1 = shifted.masked_fill(~causal, float("-inf")).softmax(-1)
    p2 = literal.masked_fill(~causal, float("-inf")).softmax(-1)
    torch.testing.assert_close(p1, p2)


def test_fused_path_equals_the_plain_path_forward_and_backward():
    """torch.compile'd projections against the plain reference, values and gradients."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        h = rand(2, 7, 4, 16, seed=30).to(dtype).requires_grad_()
        v = rand(2, 7, 4, 16, seed=31).to(dtype).requires_grad_()
        outputs = {}
        for fused in (False, True):
            delta = fam.global_orthogonal_residual(h.flatten(-2), v.flatten(-2), fused=fused)
            delta_s = fam.per_head_orthogonal_residual(h, v, fused=fused)
            loss = (delta.float().square().sum() + delta_s.float().square().sum()) / 7
            grads = torch.autograd.grad(loss, (h, v))
            outputs[fused] = (delta, delta_s, *grads)
        for plain, compiled in zip(outputs[False], outputs[True], strict=True):
            assert compiled.dtype == plain.dtype
            torch.testing.assert_close(compiled.float(), plain.float(), rtol=tol, atol=tol)


def decode(q, k, v, mixing, chunks, valid=None, **options):
    """attention_heads fed through a DecodeCache `chunks` tokens at a time (`valid` [b, s]
    False marks padding), its outputs joined along the sequence."""
    cache = fam.DecodeCache(1, mixing, options.get("head_scales", ()))
    valid = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if valid is None else valid
    outputs, start = [], 0
    for n in chunks:
        part = slice(start, start + n)
        step = cache.step(valid[:, part])
        outputs.append(fam.attention_heads(
            q[:, :, part], k[:, :, part], v[:, :, part], mixing, **options,
            cache=cache.layers[0], step=step,
        ))  # fmt: skip
        start += n
    return torch.cat(outputs, dim=2)


MIXINGS = {"softmax": {}, "bn": {"beta": 0.7}, "sh": {}, "bn_sh": {"beta": 0.7}}


@pytest.mark.parametrize("mixing", list(MIXINGS))
@pytest.mark.parametrize(
    "chunks", [[1] * 23, [5, 1, 7, 10], [3] * 7 + [2]], ids=["one-by-one", "uneven", "threes"]
)
def test_cached_heads_equal_the_full_sequence(mixing, chunks):
    """Every query's H from the cache (slots completed and partial, Attention-BN's mean over
    visible slots) equals the full-sequence math, whatever the chunking."""
    q, k, v = rand(2, 8, 23, 8, seed=40), rand(2, 4, 23, 8, seed=41), rand(2, 4, 23, 8, seed=42)
    options = {"head_scales": SCALES, **MIXINGS[mixing]}
    full = fam.attention_heads(q, k, v, mixing, **options)
    torch.testing.assert_close(decode(q, k, v, mixing, chunks, **options), full)


@pytest.mark.parametrize("mixing", list(MIXINGS))
def test_a_left_padded_row_computes_what_it_computes_alone(mixing):
    """Padding takes no position and no slot: each row of a left-padded batch equals that
    row alone, in the prompt and in the steps after it."""
    options = {"head_scales": SCALES, **MIXINGS[mixing]}
    lengths, width = [15, 9], 15
    rows = [[rand(1, h, n, 8, seed=50 + 3 * r + i) for i, h in enumerate((8, 4, 4))]
            for r, n in enumerate(lengths)]  # fmt: skip
    padded = [
        torch.cat([torch.cat((rand(1, x.shape[1], width - x.shape[2], 8, seed=60), x), 2)
                   for x in (row[i] for row in rows)])
        for i in range(3)
    ]  # fmt: skip
    valid = torch.arange(width) >= width - torch.tensor(lengths).unsqueeze(1)
    together = decode(*padded, mixing, [10, 1, 1, 3], valid, **options)
    for r, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        alone = fam.attention_heads(*row, mixing, **options)
        torch.testing.assert_close(together[r : r + 1, :, width - n :], alone)


# Documents (model.attention_mask=document): ends at positions 4, 5 (an EOS alone), 11, 14
# of row 0; row 1 one document (begun in an earlier window); row 2 starts with an EOS.
DOC_ENDS = [[4, 5, 11, 14], [], [0, 7]]


def document_window(seq_len: int = 23) -> tuple[torch.Tensor, list[list[slice]]]:
    """ends [3, seq_len] (True at each EOS) and each row's documents as slices."""
    ends = torch.zeros(len(DOC_ENDS), seq_len, dtype=torch.bool)
    spans = []
    for row, at in enumerate(DOC_ENDS):
        ends[row, at] = True
        bounds = [0, *(i + 1 for i in at), seq_len]
        spans.append([slice(a, b) for a, b in itertools.pairwise(bounds) if b > a])
    return ends, spans


def test_documents_start_after_each_eos():
    ends, spans = document_window(16)
    docs = fam.documents(ends)
    for row, row_spans in enumerate(spans):
        for span in row_spans:
            assert (docs.starts[row, span] == span.start).all()
            assert torch.equal(docs.positions[row, span], torch.arange(span.stop - span.start))


def heads_and_grads(mixing, docs, kernel, monkeypatch, seq_len=23):
    """H of random q, k, v (fp64, GQA, SH scales) under `docs` by `kernel`, and the
    gradients of a random function of it."""
    monkeypatch.setattr(fam, "document_kernel", lambda device: kernel)
    q, k, v = (rand(3, h, seq_len, 8, dtype=torch.float64, seed=80 + i).requires_grad_()
               for i, h in enumerate((8, 4, 4)))  # fmt: skip
    out = fam.attention_heads(q, k, v, mixing, head_scales=SCALES, documents=docs,
                              **MIXINGS[mixing])  # fmt: skip
    weights = rand(*out.shape, dtype=torch.float64, seed=90)
    return (out, *torch.autograd.grad((out * weights).sum(), (q, k, v))), (q, k, v)


@pytest.mark.parametrize("kernel", ["bins", "dense"])
@pytest.mark.parametrize("mixing", list(MIXINGS))
def test_each_document_computes_what_it_computes_alone(mixing, kernel, monkeypatch):
    """Attention within documents, by either CPU kernel: each document's H is the causal
    math on it alone (μ and the slots restarting with it), and so are the gradients."""
    ends, spans = document_window()
    (out, *grads), (q, k, v) = heads_and_grads(mixing, fam.documents(ends), kernel, monkeypatch)
    for row, row_spans in enumerate(spans):
        for span in row_spans:
            part = [x[row : row + 1, :, span] for x in (q, k, v)]
            alone = fam.attention_heads(*part, mixing, head_scales=SCALES, **MIXINGS[mixing])
            torch.testing.assert_close(out[row : row + 1, :, span], alone)
            weights = rand(*out.shape, dtype=torch.float64, seed=90)[row : row + 1, :, span]
            expected = torch.autograd.grad((alone * weights).sum(), part)
            for got, want in zip(grads, expected, strict=True):
                torch.testing.assert_close(got[row : row + 1, :, span], want)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_kernel_equals_the_dense_mask():
    """FlexAttention's block mask (CUDA's kernel; eager here, forward only: no CPU backward)
    sees what the dense mask sees, slots included."""
    ends, _ = document_window()
    docs = fam.documents(ends)
    q, k, v = rand(3, 8, 23, 8, seed=95), rand(3, 4, 23, 8, seed=96), rand(3, 4, 23, 8, seed=97)
    for slot_ends in (None, docs.positions % 3 == 0):
        dense = fam.document_softmax(q, k, v, docs.starts, slot_ends, None, "dense")
        flex = fam.document_softmax(q, k, v, docs.starts, slot_ends, None, "flex")
        torch.testing.assert_close(flex, dense)


def test_document_kernel_by_device(monkeypatch):
    """CUDA: FlexAttention (a dense mask would send SDPA to its math or efficient kernel);
    the CPU: bins, or the dense mask while torch.compile traces (bins' host-sized calls
    would break the graph)."""
    assert fam.document_kernel(torch.device("cuda")) == "flex"
    assert fam.document_kernel(torch.device("cpu")) == "bins"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fam.document_kernel(torch.device("cpu")) == "dense"
    assert fam.document_kernel(torch.device("cuda")) == "flex"  # compiles with the layer


def test_bins_pad_by_at_most_half():
    lengths = torch.tensor([1, 16, 17, 24, 25, 33, 100, 700, 1000, 1024, 1025])
    widths = fam.bin_widths(lengths)
    assert widths.tolist() == [16, 16, 24, 24, 32, 48, 128, 768, 1024, 1024, 1536]
    assert (widths >= lengths).all() and (widths <= 1.5 * lengths.clamp_min(16)).all()


@pytest.mark.parametrize("mixing", list(MIXINGS))
def test_cached_heads_restart_after_each_eos(mixing):
    """Decoding under documents (DecodeCache.steps: runs up to each EOS, a row's slots
    forgotten and its positions restarted after one) gives the full window's H, whatever
    the chunking, EOS in a chunk's middle, at its end or alone."""
    ends, _ = document_window()
    q, k, v = rand(3, 8, 23, 8, seed=40), rand(3, 4, 23, 8, seed=41), rand(3, 4, 23, 8, seed=42)
    options = {"head_scales": SCALES, **MIXINGS[mixing]}
    full = fam.attention_heads(q, k, v, mixing, documents=fam.documents(ends), **options)
    valid = torch.ones_like(ends)
    for chunks in ([1] * 23, [5, 1, 7, 10], [23]):
        cache, outputs, start = fam.DecodeCache(1, mixing, SCALES), [], 0
        for n in chunks:
            for run, step in cache.steps(valid[:, start : start + n], ends[:, start : start + n]):
                cols = range(start, start + n)[run]
                part = [x[:, :, cols.start : cols.stop] for x in (q, k, v)]
                outputs.append(fam.attention_heads(*part, mixing, **options,
                                                   cache=cache.layers[0], step=step))  # fmt: skip
            start += n
        torch.testing.assert_close(torch.cat(outputs, dim=2), full)
