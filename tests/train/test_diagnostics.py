"""Belief diagnostics against a direct computation from the layer's tensors."""

import torch
import torch.nn.functional as F

from belief_lm.config import load_config
from belief_lm.model.attention_layer import CAPTURE
from belief_lm.model.gpt import BeliefLM
from belief_lm.train.diagnostics import belief_diagnostics
from tests.models import ModuleEngine


def test_matches_direct_computation(single_process_group):
    cfg = load_config("configs/model/tiny.yaml", ["model.num_layers=2", "model.seq_length=16"])
    model = BeliefLM(cfg.model.model_copy(update={"attention": "belief"}), 256, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    stats = belief_diagnostics(ModuleEngine(model), tokens, tokens, pipelined=False)
    assert model.training  # restored

    # recompute layer 2's numbers by hand from MH, V and the input to layer 2
    captured, x = {}, model.layers[0](model.embedding(tokens)).detach()
    attention = model.layers[1].self_attention
    scope = CAPTURE.set(captured)
    with torch.no_grad():
        model.eval()
        model.layers[1](x)
    CAPTURE.reset(scope)
    mh, v = captured[2]["mh"].double(), captured[2]["v"].double()
    delta = mh - ((mh * v).sum(-1) / (v * v).sum(-1)).unsqueeze(-1) * v
    wo = attention.linear_proj.weight.detach().double()
    expected_ratio = (delta.norm(dim=-1) / mh.norm(dim=-1)).mean()
    expected_cos = F.cosine_similarity(delta @ wo.T, x.double(), dim=-1).mean()
    expected_cos_mh = F.cosine_similarity(mh @ wo.T, x.double(), dim=-1).mean()
    assert abs(stats["layer2/delta_over_mh"] - float(expected_ratio)) < 1e-5
    assert abs(stats["layer2/cos_delta_wo_x"] - float(expected_cos)) < 1e-5
    assert abs(stats["layer2/cos_mh_wo_x"] - float(expected_cos_mh)) < 1e-5
