"""Sampling rules and the decoding loop (on a bigram stand-in and on a real checkpoint)."""

import pytest
import torch

from belief_lm.inference.generate import Sampling, filter_logits, generate, next_token
from tests.models import ARCHITECTURES, SMALL, VARIANTS_AND_ARCHITECTURES, tokens

VOCAB = 50


def random_logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def draws(logits: torch.Tensor, sampling: Sampling, n: int = 2000) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {int(next_token(logits, sampling, generator)) for _ in range(n)}


def test_greedy_picks_the_argmax():
    logits = random_logits(8)
    torch.testing.assert_close(next_token(logits, Sampling(temperature=0)), logits.argmax(-1))


def test_top_k_never_picks_outside_the_k_best():
    logits = random_logits()
    best = set(logits[0].topk(5).indices.tolist())
    seen = draws(logits, Sampling(temperature=2.0, top_k=5))
    assert seen <= best and len(seen) > 1


def test_top_k_keeps_exactly_k_among_ties():
    assert filter_logits(torch.zeros(1, VOCAB), top_k=3).isfinite().sum() == 3


@pytest.mark.parametrize(
    ("p", "kept"), [(0.3, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()[:, torch.tensor([2, 0, 3, 1])]
    order = [1, 3, 0, 2]  # token ids by falling probability (0.5, 0.3, 0.15, 0.05)
    expected = {order[i] for i in kept}
    assert set(filter_logits(logits, top_p=p).isfinite().nonzero()[:, 1].tolist()) == expected
    assert draws(logits, Sampling(top_p=p), n=500) == expected


@pytest.mark.parametrize(
    "bad", [{"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


class Bigram(torch.nn.Module):
    """Logits [seq, batch, vocab] from the previous token only; records what it was fed."""

    def __init__(self, vocab: int = VOCAB):
        super().__init__()
        self.table = torch.nn.Parameter(
            torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1))
        )
        self.contexts: list[list[int]] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.contexts.append(tokens[0].tolist())
        return self.table[tokens].transpose(0, 1)


def run(model, prompt=(5, 6, 7), n=20, sampling=None, **kwargs):
    options = {"context_length": 8, "vocab_size": VOCAB, "seed": 0} | kwargs
    return generate(model, list(prompt), n, sampling or Sampling(), **options)


def test_same_seed_same_tokens_and_another_seed_differs():
    model = Bigram()
    assert run(model) == run(model)
    assert run(model) != run(model, seed=1)


def test_context_is_cropped_to_the_last_tokens():
    model = Bigram()
    new = run(model, n=12)
    full = [5, 6, 7, *new]
    assert len(new) == 12
    for step, context in enumerate(model.contexts):
        assert context == full[: 3 + step][-8:]


def test_greedy_follows_the_argmax_chain_and_stops_before_eos():
    model = Bigram()
    with torch.no_grad():
        for token, successor in [(7, 9), (9, 11), (11, 13), (13, 2)]:
            model.table[token, successor] = 100.0
    assert run(model, sampling=Sampling(temperature=0), eos_id=2) == [9, 11, 13]


def test_a_stop_condition_ends_generation_after_the_token_that_met_it():
    new = run(Bigram(), stop=lambda ids: len(ids) == 3)
    assert new == run(Bigram(), n=3)


def test_ids_past_the_tokenizer_vocabulary_are_never_generated():
    model = Bigram()
    with torch.no_grad():
        model.table[:, 40:] += 100.0  # the padded rows would win every time
    assert max(run(model, vocab_size=40, n=30)) < 40


def test_real_checkpoint_generates_reproducibly(make_checkpoint):
    from belief_lm.inference.load import load_model

    loaded = load_model(make_checkpoint(attention="belief_star"), device="cpu")
    prompt = loaded.tokenizer.encode("The for statement")
    options = {"context_length": loaded.context_length, "vocab_size": loaded.tokenizer.vocab_size}
    sampled = [generate(loaded.model, prompt, 24, Sampling(top_k=20, top_p=0.9), **options)
               for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1] and len(sampled[0]) == 24  # longer than the 16-token context
    greedy = generate(loaded.model, prompt, 4, Sampling(temperature=0), **options)
    with torch.no_grad():
        first = loaded.model(torch.tensor([prompt]))[-1, 0, : options["vocab_size"]].argmax()
    assert greedy[0] == int(first)


@pytest.mark.parametrize(("variant", "arch"), VARIANTS_AND_ARCHITECTURES)
def test_cached_decoding_equals_recomputing(single_process_group, variant, arch):
    """The logits of a prompt and then of one token at a time through the cache equal the
    whole sequence's, and greedy decoding past the 16-token context (where every step
    recomputes the cropped context) gives the tokens it gives without a cache."""
    from belief_lm.config import ModelConfig
    from belief_lm.model.gpt import BeliefLM

    model = BeliefLM(ModelConfig(**SMALL, attention=variant, **ARCHITECTURES[arch]), 512, seed=3)
    model.eval()
    ids = tokens(16, rows=1)
    with torch.no_grad():
        cache = model.decode_cache()
        steps = [model(ids[:, :6], cache=cache)]
        steps += [model(ids[:, i : i + 1], cache=cache) for i in range(6, 16)]
        torch.testing.assert_close(torch.cat(steps), model(ids), rtol=1e-5, atol=1e-4)
    fed = []  # (tokens, with a cache) of every forward
    model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append((args[0].shape[1], "cache" in kwargs)),
        with_kwargs=True,
    )
    options = {"context_length": 16, "vocab_size": 400}
    cached = generate(model, ids[0, :10].tolist(), 12, Sampling(temperature=0), **options)
    assert fed == [(10, True)] + [(1, True)] * 6 + [(16, False)] * 5  # 11..16, then 17+
    recomputed = generate(model, ids[0, :10].tolist(), 12, Sampling(temperature=0), **options,
                          use_cache=False)  # fmt: skip
    assert cached == recomputed and len(set(cached)) > 2, cached


DOCUMENT_CASES = [("attention_bn_sh", "llama"), ("attention_sh", "gpt2")]
"""Every running statistic with RoPE, Attention-SH's slots with learned positions."""


@pytest.mark.parametrize(("variant", "arch"), DOCUMENT_CASES)
def test_document_mask_decoding(single_process_group, variant, arch):
    """model.attention_mask=document through the cache: a prompt holding EOS (fed whole, and
    then EOS fed alone) gives the whole sequence's logits; a prompt's earlier documents do
    not change what follows once the current document has begun, with or without the
    cache, greedy or sampled (under the causal mask they do)."""
    from belief_lm.config import ModelConfig
    from belief_lm.model.gpt import BeliefLM

    eos = 2
    models = {
        mask: BeliefLM(ModelConfig(**SMALL, attention=variant, attention_mask=mask,
                                   **ARCHITECTURES[arch]), 512, seed=3, eos_id=eos).eval()
        for mask in ("document", "causal")
    }  # fmt: skip
    model = models["document"]
    ids = tokens(16, rows=1)
    ids[0, [3, 4, 9, 13]] = eos  # documents of 4, 1, 5, 4 tokens and one cut by the end
    with torch.no_grad():
        cache = model.decode_cache()
        steps = [model(ids[:, :7], cache=cache)]  # with two EOS inside
        steps += [model(ids[:, i : i + 1], cache=cache) for i in range(7, 16)]  # EOS alone
        torch.testing.assert_close(torch.cat(steps), model(ids), rtol=1e-5, atol=1e-4)
    earlier, current = ids[0, :10].tolist(), tokens(4, seed=5, rows=1)[0].tolist()
    options = {"context_length": 16, "vocab_size": 400}
    for sampling in (Sampling(temperature=0), Sampling(top_k=20)):
        for use_cache in (True, False):
            alone = generate(model, current, 5, sampling, **options, use_cache=use_cache)
            after = generate(model, [*earlier, *current], 5, sampling, **options,
                             use_cache=use_cache)  # fmt: skip
            assert after == alone
        causal = models["causal"]
        alone = generate(causal, current, 5, sampling, **options)
        assert generate(causal, [*earlier, *current], 5, sampling, **options) != alone


def test_generate_command_prints_the_greedy_continuation(make_checkpoint):
    from test_cli import belief_lm  # the CLI as a subprocess, as tests/test_cli.py runs it

    from belief_lm.inference.load import load_model

    checkpoint = make_checkpoint(attention="belief")
    out = belief_lm(
        "generate", "--checkpoint", str(checkpoint), "--prompt", "The for statement",
        "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu", timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = load_model(checkpoint, device="cpu")
    prompt = loaded.tokenizer.encode("The for statement")
    new = generate(
        loaded.model, prompt, 6, Sampling(temperature=0), context_length=16,
        vocab_size=loaded.tokenizer.vocab_size, eos_id=loaded.tokenizer.eos_id,
    )  # fmt: skip
    assert out.stdout == loaded.tokenizer.decode(prompt + new) + "\n"
    assert "new tokens in" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "1.5"], "top-p must be in (0, 1], got 1.5"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0"),
        (["--prompt", ""], "the prompt is empty"),
    ],
)
def test_generate_command_refuses_bad_input_with_2(make_checkpoint, capsys, args, message):
    from belief_lm.cli import main

    command = ["generate", "--checkpoint", str(make_checkpoint()), "--prompt", "x", *args]
    assert main(command) == 2
    assert message in capsys.readouterr().err
