"""Per-layer signals against direct computations on a tiny model, and the layer a spike
injected into one layer's gradient is named by."""

import json
import math

import pytest
import torch

from belief_lm.attention import causal_pool, documents, max_logit
from belief_lm.config import load_config
from belief_lm.model.gpt import BeliefLM
from belief_lm.train.diagnostics import belief_diagnostics
from belief_lm.train.layer_signals import GradientWatch
from belief_lm.train.loop import train
from tests.jobs import MICRO
from tests.models import ModuleEngine


def reference_max_logit(q, k, mixing, beta, scales, softmax_scale):
    """Every score one by one, as the variants define them (float64)."""
    q, k = q.double(), k.double()
    heads, seq = q.shape[1], q.shape[2]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    best = -math.inf
    for b in range(q.shape[0]):
        for h in range(heads):
            scale = scales[h] if mixing in ("sh", "bn_sh") else 1
            keys = causal_pool(k[b : b + 1, h : h + 1], scale, dim=2)[0, 0]
            for i in range(seq):
                visible = keys[: i // scale + 1]
                qi = q[b, h, i]
                if mixing in ("bn", "bn_sh"):
                    mean = visible.mean(0)
                    qi, visible = qi - beta * mean, visible - beta * mean
                best = max(best, float((visible @ qi).max()) * softmax_scale)
    return best


@pytest.mark.parametrize("mixing", ["softmax", "bn", "sh", "bn_sh"])
def test_max_logit_matches_each_score(mixing):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 11, 8, generator=generator)
    k = torch.randn(2, 2, 11, 8, generator=generator) + 0.5  # GQA groups, a mean to remove
    scales = [1, 2, 2, 3]
    found = max_logit(q, k, mixing, beta=0.7, head_scales=scales, softmax_scale=0.3)
    assert float(found) == pytest.approx(reference_max_logit(q, k, mixing, 0.7, scales, 0.3))


@pytest.mark.parametrize("mixing", ["softmax", "bn", "sh", "bn_sh"])
def test_max_logit_within_documents_is_each_documents_alone(mixing):
    """Under model.attention_mask=document the largest logit is that of the documents each
    run alone (keys, Attention-BN's mean and Attention-SH's slots restarting at each
    document), not of scores across their boundaries."""
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 12, 8, generator=generator)
    k = torch.randn(2, 2, 12, 8, generator=generator) + 0.5
    ends = torch.zeros(2, 12, dtype=torch.bool)
    ends[0, [3, 4, 9]] = True  # documents 0-3, 4 (one EOS alone), 5-9, 10-11 (begun)
    ends[1, 6] = True
    scales = [1, 2, 2, 3]
    found = max_logit(q, k, mixing, beta=0.7, head_scales=scales, softmax_scale=0.3,
                      documents=documents(ends))  # fmt: skip
    alone = []
    for row, pieces in ((0, [(0, 4), (4, 5), (5, 10), (10, 12)]), (1, [(0, 7), (7, 12)])):
        for a, b in pieces:
            part = q[row : row + 1, :, a:b], k[row : row + 1, :, a:b]
            alone.append(reference_max_logit(*part, mixing, 0.7, scales, 0.3))
    assert float(found) == pytest.approx(max(alone))
    across = max_logit(q, k, mixing, beta=0.7, head_scales=scales, softmax_scale=0.3)
    assert float(across) != pytest.approx(max(alone))  # (the boundaries change the answer)


def test_forward_signals_match_direct_computation(single_process_group):
    cfg = load_config("configs/model/tiny.yaml", ["model.num_layers=2", "model.seq_length=16"])
    model = BeliefLM(cfg.model.model_copy(update={"attention": "belief_star"}), 256, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = {}  # each layer's queries and keys, as its core attention gets them
    hooks = [
        layer.self_attention.core_attention.register_forward_hook(
            lambda module, args, out: seen.__setitem__(module.layer_number, args[:2])
        )
        for layer in model.layers
    ]
    stats = belief_diagnostics(ModuleEngine(model), tokens, tokens, pipelined=False)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        model.eval()
        x = model.embedding(tokens)
        for number, layer in enumerate(model.layers, start=1):
            x = layer(x)
            rms = float(x.double().square().mean().sqrt())
            assert stats[f"layer{number}/output_rms"] == pytest.approx(rms, rel=1e-6)
            query, key = (t.permute(1, 2, 0, 3) for t in seen[number])  # [b, heads, s, d]
            scale = layer.self_attention.core_attention.softmax_scale or query.shape[-1] ** -0.5
            expected = reference_max_logit(query, key, "softmax", 1.0, [], scale)
            assert stats[f"layer{number}/max_logit"] == pytest.approx(expected, rel=1e-6)


def test_gradient_norms_and_the_layer_a_spike_names(single_process_group):
    cfg = load_config("configs/model/tiny.yaml", ["model.num_layers=3", "model.seq_length=16"])
    model = BeliefLM(cfg.model, 256, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    watch = GradientWatch(model)
    model(tokens, tokens).backward()
    norms = watch.measure()
    for number, layer in enumerate(model.layers, start=1):
        direct = torch.cat([p.grad.double().flatten() for p in layer.parameters()]).norm()
        assert norms[f"layer{number}/grad_norm"] == pytest.approx(float(direct), rel=1e-9)
    watch.step_done()
    model.zero_grad()
    model(tokens, tokens).backward()
    for param in model.layers[1].parameters():  # a spike injected into layer 2's gradient
        param.grad *= 50
    measured, grown = watch.spike_report()
    assert grown[0][0] == "layer2" and grown[0][1] == pytest.approx(50, rel=0.2)
    assert measured["layer2/grad_norm"] > 10 * norms["layer2/grad_norm"]


def test_signals_are_logged_at_the_diagnostics_interval(tmp_path, cache_dir):
    """Through the training loop: rows every 2 steps in metrics.jsonl, and the same numbers
    in tensorboard under layers/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides = [
        f"run.output_dir={tmp_path}", f"run.cache_dir={cache_dir}", "train.max_steps=4",
        "run.diagnostics_interval=2", "data.num_workers=1", "checkpoint.save_at_end=false",
        "run.tensorboard=true",
    ]  # fmt: skip
    train(load_config(MICRO, overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    signals = [row for row in rows if "layer1/grad_norm" in row]
    assert [row["step"] for row in signals] == [2, 4], [sorted(r) for r in rows[-3:]]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for row in signals:
        for n in (1, 2):
            assert row[f"layer{n}/grad_norm"] > 0 and row[f"layer{n}/output_rms"] > 0
            assert math.isfinite(row[f"layer{n}/max_logit"])
    for name in ("grad_norm", "output_rms", "max_logit"):
        for n in (1, 2):
            logged = {e.step: e.value for e in events.Scalars(f"layers/layer{n}/{name}")}
            expected = {row["step"]: row[f"layer{n}/{name}"] for row in signals}
            assert logged == pytest.approx(expected, rel=1e-6)  # (tensorboard keeps float32)
