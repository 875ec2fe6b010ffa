import pytest
import torch

from belief_lm.config import load_config
from belief_lm.model.gpt import BeliefLM
from belief_lm.train.flops import (
    flops_per_token,
    matmul_weights,
    peak_tflops,
    recompute_flops_per_token,
)
from belief_lm.variants import VARIANTS


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m", "llama-188m"])
@pytest.mark.parametrize("variant", ["softmax", "belief_star"])
def test_matmul_weights_match_the_model(single_process_group, preset, variant):
    cfg = load_config(f"configs/model/{preset}.yaml", [f"model.attention={variant}"]).model
    vocab = cfg.vocab_size or 4096
    with torch.device("meta"):
        model = BeliefLM(cfg, vocab)
    counted = sum(
        p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "embedding" not in name
    )
    output = model.embedding.word_embeddings.weight.numel() if cfg.tie_embeddings else 0
    assert matmul_weights(cfg, vocab) == counted + output


def test_flops_per_token_and_peak():
    cfg = load_config("configs/model/gpt2-124m.yaml").model
    # nanoGPT's estimate for GPT-2 small: 6N + 12 L H Q T with N = non-embedding + head
    n = matmul_weights(cfg, 50304)
    assert flops_per_token(cfg, 50304) == 6 * n + 12 * 12 * 1024 * 768
    assert peak_tflops(torch.device("cpu"), None) is None
    assert peak_tflops(torch.device("cpu"), 2.5) == 2.5
    assert set(VARIANTS) >= {"belief_star"}


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0)],
)
def test_peak_of_a_gpu_by_its_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
    assert peak_tflops(torch.device("cuda", 0), None) == peak


def test_recompute_adds_a_forward_of_what_it_recomputes():
    """full: every layer's forward again (its matmuls' 2 FLOPs per weight and token, the
    attention's 4 x seq x hidden); selective: the attention's forward only."""
    cfg = load_config("configs/model/llama-188m.yaml", ["model.attention=belief_star"]).model
    layers, seq, hidden = cfg.num_layers, cfg.seq_length, cfg.hidden_size
    per_layer = matmul_weights(cfg, 0) // layers  # the head's weights counted at vocab 0
    assert recompute_flops_per_token(cfg, "none") == 0
    assert recompute_flops_per_token(cfg, "selective") == 4 * layers * seq * hidden
    full = layers * (2 * per_layer + 4 * seq * hidden)
    assert recompute_flops_per_token(cfg, "full") == pytest.approx(full)
