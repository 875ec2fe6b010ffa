"""The Hugging Face export: transformers loads it and computes what BeliefLM computes."""

import re
import subprocess
import sys

import pytest
import torch

from belief_lm.checkpoint.consolidate import consolidate
from belief_lm.export import export
from belief_lm.inference.generate import Sampling, generate
from belief_lm.inference.load import load_model
from belief_lm.variants import VARIANTS
from tests.models import ARCHITECTURES, LLAMA_LIKE, SMALL, VARIANTS_AND_ARCHITECTURES, tokens

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


@pytest.mark.parametrize(
    ("variant", "arch"), [("attention_bn", "llama"), ("belief_star", "llama"), ("softmax", "gpt2")]
)
def test_logits_equal_ours_with_qk_norm(make_checkpoint, tmp_path, variant, arch):
    """model.qk_norm exported (q_norm, k_norm of each layer, random weights): the logits of
    the whole sequence and of each step through the cache are ours (RoPE and GQA, the
    recentring of Attention-BN, learned positions)."""
    from belief_lm.checkpoint.manifest import seal

    checkpoint = make_checkpoint(seed=3, attention=variant, qk_norm=True, **ARCHITECTURES[arch])
    states = checkpoint / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=True)
    norms = [n for n in saved["module"] if re.search(r"\.[qk]_layernorm\.weight$", n)]
    assert len(norms) == 4  # 2 layers, queries and keys
    generator = torch.Generator().manual_seed(0)
    for name in norms:  # away from their initial ones: a misplaced weight shows
        saved["module"][name] = 1 + 0.5 * torch.randn(
            saved["module"][name].shape, generator=generator
        )
    torch.save(saved, states)
    seal(checkpoint)
    ours = load_model(checkpoint, device="cpu").model
    _, hf = hf_export(checkpoint, tmp_path)
    torch.testing.assert_close(
        hf.model.layers[1].self_attn.k_norm.weight,
        saved["module"]["layers.1.self_attention.k_layernorm.weight"],
    )
    ids = tokens(16)
    with torch.no_grad():
        expected = ours(ids).transpose(0, 1)
        torch.testing.assert_close(hf(ids).logits, expected, rtol=1e-5, atol=1e-5)
        out = hf(ids[:, :6], use_cache=True)
        steps = [out.logits]
        for i in range(6, 16):
            out = hf(ids[:, i : i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-4)
    assert hf.config.qk_norm


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_variants_differ_far_beyond_the_tolerance(single_process_group, arch):
    """So that matching each variant within 1e-5 means computing that variant."""
    from belief_lm.config import ModelConfig
    from belief_lm.model.gpt import BeliefLM

    logits = {}
    for variant in VARIANTS:
        cfg = ModelConfig(**SMALL, attention=variant, **ARCHITECTURES[arch])
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


def until_eos(ids: list[int]) -> list[int]:
    """The ids before the first EOS: what our generator returns (it stops before EOS)."""
    return ids[: ids.index(2)] if 2 in ids else ids


def greedy(hf, prompts: list[list[int]], use_cache: bool, new: int = 12) -> list[list[int]]:
    """transformers' greedy continuations of `prompts`, left-padded into one batch."""
    width = max(map(len, prompts))
    batch = torch.tensor([[3] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        batch, attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=use_cache
    )
    return [until_eos(row) for row in out[:, width:].tolist()]


@pytest.mark.parametrize(("variant", "arch"), VARIANTS_AND_ARCHITECTURES)
def test_generate_with_the_cache_equals_without_it_and_ours(
    make_checkpoint, tmp_path, variant, arch
):
    """Greedy continuations past the 16-token context: with the cache, without it, and by
    our generator, alone and as rows of a left-padded batch of prompts of other lengths."""
    checkpoint = make_checkpoint(seed=5, attention=variant, **ARCHITECTURES[arch])
    loaded = load_model(checkpoint, device="cpu")
    _, hf = hf_export(checkpoint, tmp_path)
    fed = []  # (tokens, whether a cache held earlier ones) of every forward
    hf.model.register_forward_pre_hook(
        lambda module, args: fed.append(
            (args[0].shape[1], args[1] is not None and args[1].columns > 0)
        )
    )
    prompts = [tokens(10, seed=1, rows=1)[0].tolist(), tokens(5, seed=2, rows=1)[0].tolist()]
    ours = [
        generate(loaded.model, p, 12, Sampling(temperature=0), context_length=16,
                 vocab_size=loaded.tokenizer.vocab_size, eos_id=2)
        for p in prompts
    ]  # fmt: skip
    assert len(set(ours[0])) > 2, ours  # a real sequence, not one token repeated
    fed.clear()
    alone = greedy(hf, prompts[:1], use_cache=True)
    assert alone == ours[:1]
    # the prompt once, then one token per step while the context fits, then recomputed
    steps = len(alone[0]) + (len(alone[0]) < 12)  # a forward also chose the EOS
    expected = [(10, False)] + [(1, True)] * min(steps - 1, 6) + [(16, False)] * (steps - 7)
    assert fed == expected
    assert greedy(hf, prompts[:1], use_cache=False) == ours[:1]
    assert greedy(hf, prompts, use_cache=True) == greedy(hf, prompts, use_cache=False) == ours
    ids = tokens(16, seed=3, rows=1)  # and the logits of every step, through the cache
    with torch.no_grad():
        out = hf(ids[:, :6], use_cache=True)
        steps = [out.logits]
        for i in range(6, 16):
            out = hf(ids[:, i : i + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
        full = hf(ids, use_cache=False).logits
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-4)


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


@pytest.mark.parametrize(
    ("variant", "qk_norm"), [(v, False) for v in VARIANTS] + [("belief_star", True)]
)
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_export_and_import_read_one_table(arch, variant, qk_norm):
    """hf_state_dict writes exactly the description's Hugging Face tensors, and
    from_hf_state_dict, reading the same table the other way, gives every tensor back."""
    from belief_lm.config import ModelConfig
    from belief_lm.description import describe
    from belief_lm.export.hf import from_hf_state_dict, hf_state_dict

    model = ModelConfig(**SMALL, attention=variant, qk_norm=qk_norm, **ARCHITECTURES[arch])
    description = describe(model, 512)
    generator = torch.Generator().manual_seed(0)
    ours = {w.name: torch.randn(w.shape, generator=generator) for w in description.weights()}
    theirs = hf_state_dict(ours, description)
    assert {n: tuple(t.shape) for n, t in theirs.items()} == {
        part.name: w.hf_shape(part) for w in description.weights() for part in w.hf
    }
    back = from_hf_state_dict(theirs, description)
    assert back.keys() == ours.keys()
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor), name


def test_import_refuses_tensors_that_do_not_fit():
    """A tensor the model has no place for, one of the wrong shape, a fused weight given in
    part: each a ValueError naming the tensor; a weight given not at all is left out."""
    from belief_lm.config import ModelConfig
    from belief_lm.description import describe
    from belief_lm.export.hf import from_hf_state_dict

    description = describe(ModelConfig(**SMALL, **LLAMA_LIKE), 512)
    full = {p.name: torch.zeros(w.hf_shape(p)) for w in description.weights() for p in w.hf}
    q = "model.layers.1.self_attn.q_proj.weight"
    cases = [
        ({**full, "model.rotary_emb.inv_freq": torch.zeros(4)}, "model.rotary_emb.inv_freq"),
        ({**full, q: torch.zeros(33, 32)}, f"tensor {q}: shape (33, 32), the run's model has"),
        ({n: t for n, t in full.items() if n != q}, "layers.1.self_attention.linear_qkv.weight"),
    ]
    for state, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            from_hf_state_dict(state, description)
    lacking = {n: t for n, t in full.items() if "o_proj" not in n}
    assert len(from_hf_state_dict(lacking, description)) == len(description.weights()) - 2
