"""The assembled model: presets' parameter counts, causality, seeded initialisation."""

import pytest
import torch

from belief_lm.config import ModelConfig, load_config, padded_vocab_size
from belief_lm.model.attention_layer import FamilyCoreAttention
from belief_lm.model.gpt import BeliefLM, DecoderLayer
from belief_lm.parallel.gather import count_model_parameters
from belief_lm.variants import VARIANTS
from tests.models import tiny_model

pytestmark = pytest.mark.usefixtures("single_process_group")


def preset(name: str, **updates) -> ModelConfig:
    return load_config(f"configs/model/{name}.yaml").model.model_copy(update=updates)


def meta_count(model: ModelConfig) -> int:
    with torch.device("meta"):
        return count_model_parameters(BeliefLM(model, model.vocab_size))


def test_llama_188m_counts_from_the_issue():
    assert meta_count(preset("llama-188m")) == 181_095_168
    assert meta_count(preset("llama-188m", attention="belief_star")) == 188_173_056


def test_gpt2_124m_matches_nanogpt():
    # nanoGPT's GPT-2 small at vocab 50304, position embeddings included
    assert meta_count(preset("gpt2-124m")) == 124_475_904


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m", "llama-188m"])
def test_belief_adds_nothing_and_belief_star_adds_w_s(name):
    base = preset(name, vocab_size=4096)
    softmax = meta_count(base)
    for variant in VARIANTS:
        extra = meta_count(base.model_copy(update={"attention": variant})) - softmax
        expected = base.num_layers * base.hidden_size**2 if variant == "belief_star" else 0
        assert extra == expected, variant


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_is_causal(variant):
    model = BeliefLM(tiny_model(variant), vocab_size=256, seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32), generator=gen)
    changed = tokens.clone()
    t = 12
    changed[:, t + 1 :] = torch.randint(0, 256, (2, 32 - t - 1), generator=gen)
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[: t + 1], b[: t + 1], rtol=0, atol=1e-5)
    assert not torch.allclose(a[t + 1 :], b[t + 1 :], atol=1e-3)


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m"])
def test_gpt2_and_tiny_tie_embeddings(name):
    cfg = preset(
        name,
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        num_query_groups=None,
        vocab_size=256,
        seq_length=16,
    )
    model = BeliefLM(cfg, 256)
    assert model.output_layer.weight is None
    tokens = torch.randint(0, 256, (1, 16))
    logits = model(tokens)
    hidden = model.final_norm(model.layers[0](model.embedding(tokens)))
    torch.testing.assert_close(logits, hidden @ model.embedding.word_embeddings.weight.T)


def test_initial_weights_depend_only_on_the_seed():
    cfg = tiny_model("belief_star")
    a, b, c = BeliefLM(cfg, 256, seed=1), BeliefLM(cfg, 256, seed=1), BeliefLM(cfg, 256, seed=2)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if pa.ndim >= 2:
            assert not torch.equal(pa, pc), name
    # W^o and W^s are separately named and separately drawn
    attn = a.layers[0].self_attention.linear_proj
    assert not torch.equal(attn.weight, attn.w_s.weight)
    names = {n for n, _ in a.named_parameters()}
    assert "layers.0.self_attention.linear_proj.weight" in names
    assert "layers.0.self_attention.linear_proj.w_s.weight" in names


def test_loss_is_cross_entropy_of_logits():
    model = BeliefLM(tiny_model("belief"), vocab_size=256, seed=0)
    tokens = torch.randint(0, 256, (2, 32))
    labels = torch.randint(0, 256, (2, 32))
    logits = model(tokens)  # [s, b, v]
    expected = torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels)
    torch.testing.assert_close(model(tokens, labels), expected)


def test_vocab_padding():
    tiny = preset("tiny")
    assert padded_vocab_size(4096, tiny, 1) == 4096
    assert padded_vocab_size(4097, tiny, 1) == 4224
    assert padded_vocab_size(4097, tiny, 2) == 4224  # independent of the layout
    llama = preset("llama-188m")
    assert padded_vocab_size(32000, llama, 4) == 50304
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        padded_vocab_size(60000, llama, 1)
    with pytest.raises(ValueError, match=r"vocabulary \(4224\) is not divisible by the tensor"):
        padded_vocab_size(4097, tiny, 5)


@pytest.mark.parametrize(
    ("variant", "mask"),
    [("softmax", "causal"), ("belief_star", "causal"), ("attention_bn_sh", "causal"),
     ("attention_bn_sh", "document")],
)  # fmt: skip
def test_recompute_gives_the_same_gradients(variant, mask, monkeypatch):
    """train.activation_checkpointing: selective reruns each layer's attention core in
    backward, full each whole layer; both give the loss and every gradient of storing
    everything (fp32), under the document mask too (an EOS every few tokens)."""
    calls = {"layer": 0, "core": 0}

    def counting(cls, name, key):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            calls[key] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(DecoderLayer, "_forward", "layer")
    counting(FamilyCoreAttention, "_attend", "core")
    cfg = tiny_model(variant, attention_mask=mask)
    rows = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    rows[:, 5::7] = 2  # EOS: documents of 7 tokens
    results = {}
    for mode in ("none", "selective", "full"):
        model = BeliefLM(cfg, 256, seed=3, recompute=mode, eos_id=2)
        calls.update(layer=0, core=0)
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results[mode] = (loss.detach(), grads, dict(calls))
    layers = cfg.num_layers
    assert results["none"][2] == {"layer": layers, "core": layers}
    assert results["selective"][2] == {"layer": layers, "core": 2 * layers}
    assert results["full"][2] == {"layer": 2 * layers, "core": 2 * layers}
    loss, grads, _ = results["none"]
    for mode in ("selective", "full"):
        torch.testing.assert_close(results[mode][0], loss, rtol=1e-6, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(results[mode][1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
