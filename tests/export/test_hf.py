"""The Hugging Face export: transformers loads it and computes what BeliefLM computes."""

import subprocess
import sys

import pytest
import torch

from belief_lm.checkpoint.consolidate import consolidate
from belief_lm.export import export
from belief_lm.inference.generate import Sampling, generate
from belief_lm.inference.load import load_model
from belief_lm.variants import VARIANTS

GPT2_LIKE = {
    "normalization": "LayerNorm",
    "activation": "gelu",
    "position_embedding": "learned_absolute",
    "tie_embeddings": True,
    "bias": True,
}
LLAMA_LIKE = {
    "normalization": "RMSNorm",
    "activation": "swiglu",
    "position_embedding": "rope",
    "rotary_base": 500.0,
    "num_query_groups": 2,
    "tie_embeddings": False,
    "bias": False,
}
ARCHITECTURES = {"gpt2": GPT2_LIKE, "llama": LLAMA_LIKE}
TEXTS = ["The for statement", " two  spaces\n\ttab </s> <s> <pad>", "ünïcödé ✓ 𝔘 €42", ""]


def hf_export(checkpoint, tmp_path, name="hf"):
    """Export and load with transformers; fail on any weight it did not find."""
    from transformers import AutoModelForCausalLM

    out = export(checkpoint, "hf", tmp_path / name)
    model, info = AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, output_loading_info=True
    )
    assert not any(info.values()), info  # missing / unexpected / mismatched keys, errors
    return out, model.eval()


def without_eos(generated: list[int]) -> list[int]:
    """transformers ends a sequence with the EOS it stopped at; ours stops before it."""
    return generated[:-1] if generated and generated[-1] == 2 else generated


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 400, (2, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_logits_equal_ours(make_checkpoint, tmp_path, arch, variant):
    checkpoint = make_checkpoint(seed=3, attention=variant, **ARCHITECTURES[arch])
    ours = load_model(checkpoint, device="cpu").model
    _, hf = hf_export(checkpoint, tmp_path)
    ids = tokens(16)
    with torch.no_grad():
        expected = ours(ids).transpose(0, 1)
        torch.testing.assert_close(hf(ids).logits, expected, rtol=1e-5, atol=1e-5)
        assert hf.config.attention == variant


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_variants_differ_far_beyond_the_tolerance(single_process_group, arch):
    """So that matching each variant within 1e-5 means computing that variant."""
    from belief_lm.config import ModelConfig
    from belief_lm.model.gpt import BeliefLM

    small = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "seq_length": 16}
    logits = {}
    for variant in VARIANTS:
        cfg = ModelConfig(**small, init_std=0.3, attention=variant, **ARCHITECTURES[arch])
        with torch.no_grad():
            logits[variant] = BeliefLM(cfg, 512, seed=3).eval()(tokens(16))
    for a in VARIANTS:
        for b in VARIANTS:
            assert a == b or (logits[a] - logits[b]).abs().max() > 1e-2, (a, b)


def test_runs_in_bfloat16(make_checkpoint, tmp_path):
    checkpoint = make_checkpoint(seed=3, attention="belief_star", **LLAMA_LIKE)
    _, hf = hf_export(checkpoint, tmp_path)
    ids = tokens(16)
    with torch.no_grad():
        full = hf(ids).logits
        half = hf.to(torch.bfloat16)(ids).logits
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() < 0.05 * full.abs().max()


def test_tokenizer_matches_ours(make_checkpoint, small_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    out = export(make_checkpoint(), "hf", tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert hf(TEXTS)["input_ids"] == [small_tokenizer.encode(t) for t in TEXTS]
    for text in TEXTS:
        ids = hf.encode(text)
        assert hf.decode(ids) == small_tokenizer.decode(ids) == text
    assert (hf.unk_token_id, hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2, 3)
    assert len(hf) == small_tokenizer.vocab_size


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_transformers_greedy_generate_equals_ours(make_checkpoint, tmp_path, arch):
    checkpoint = make_checkpoint(seed=5, attention="belief_star", **ARCHITECTURES[arch])
    loaded = load_model(checkpoint, device="cpu")
    _, hf = hf_export(checkpoint, tmp_path)
    prompt = loaded.tokenizer.encode("The with statement is used")  # 10+ of 16 positions
    ours = generate(
        loaded.model, prompt, 12, Sampling(temperature=0), context_length=16,
        vocab_size=loaded.tokenizer.vocab_size, eos_id=2,
    )  # fmt: skip
    prompt_ids = torch.tensor([prompt])
    theirs = hf.generate(
        prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=12, do_sample=False
    )
    assert ours == without_eos(theirs[0, len(prompt) :].tolist())
    assert len(set(ours)) > 2, ours  # a real sequence, not one token repeated
    with pytest.raises(ValueError, match="padding is unsupported"):
        hf(prompt_ids, attention_mask=torch.zeros_like(prompt_ids))


def test_real_checkpoint_loads_without_belief_lm(trained_checkpoint, tmp_path):
    """A trained checkpoint, exported, then loaded by a process where belief-lm, megatron and
    DeepSpeed cannot be imported: same logits, same ids, same greedy continuation."""
    out = export(trained_checkpoint, "hf", tmp_path / "trained-hf")
    loaded = load_model(trained_checkpoint, device="cpu")
    ids = tokens(32)
    results = tmp_path / "results.pt"
    script = f"""
import sys, torch
for name in ("belief_lm", "data_pipeline", "launcher", "megatron", "deepspeed"):
    sys.modules[name] = None  # importing any of them fails
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
inputs = tokenizer("The import statement", return_tensors="pt")
prompt = inputs["input_ids"][0].tolist()
with torch.no_grad():
    logits = model(torch.tensor({ids.tolist()})).logits
    greedy = model.generate(**inputs, max_new_tokens=8, do_sample=False)
torch.save({{"logits": logits, "prompt": prompt, "greedy": greedy[0, len(prompt):].tolist(),
            "ids": tokenizer({TEXTS!r})["input_ids"]}}, {str(results)!r})
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = torch.load(results)
    with torch.no_grad():
        torch.testing.assert_close(
            got["logits"], loaded.model(ids).transpose(0, 1), rtol=1e-5, atol=1e-5
        )
    assert got["prompt"] == loaded.tokenizer.encode("The import statement")
    assert got["ids"] == [loaded.tokenizer.encode(t) for t in TEXTS]
    ours = generate(
        loaded.model, got["prompt"], 8, Sampling(temperature=0), context_length=32,
        vocab_size=loaded.tokenizer.vocab_size, eos_id=2,
    )  # fmt: skip
    assert ours == without_eos(got["greedy"])
    assert consolidate(trained_checkpoint).info.step == 3
