"""model.attention_mask=document: a window that packs several documents computes, for every
variant, what each document computes alone (logits and gradients), and the ways to get it
wrong (statistics or positions that run on across a boundary, a mask off by one) show."""

import pytest
import torch

from belief_lm import attention as family
from belief_lm.config import ModelConfig
from belief_lm.errors import BadInput
from belief_lm.model import gpt
from belief_lm.model.gpt import BeliefLM
from tests.models import ARCHITECTURES, SMALL, VARIANTS_AND_ARCHITECTURES

pytestmark = pytest.mark.usefixtures("single_process_group")

EOS, VOCAB = 2, 64
DOCUMENTS = [[16], [7, 9], [4, 1, 5, 3, 3], [1, 15]]
"""Document lengths of each row of a 16-token window (the EOS ending a document is its
last token; a row's last document is cut by the window's end, so it has none). Row 0 is
one document (one that began in an earlier window looks the same: it starts at the
window's start); row 1 two; row 2 five, one of them an EOS alone (an empty document);
row 3 starts with an EOS, the end of a document of the previous window."""


def packed_window(seed: int = 0) -> tuple[torch.Tensor, list[list[slice]]]:
    """Tokens [rows, 16] with an EOS closing every document but each row's last, and each
    row's documents as column slices."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, VOCAB, (len(DOCUMENTS), 16), generator=generator)
    spans = []
    for row, lengths in enumerate(DOCUMENTS):
        ends = torch.tensor(lengths).cumsum(0)
        tokens[row, ends[:-1] - 1] = EOS
        spans.append([slice(int(e - n), int(e)) for n, e in zip(lengths, ends, strict=True)])
    return tokens, spans


def model_config(variant: str, arch: str, mask: str = "document") -> ModelConfig:
    return ModelConfig(**SMALL, attention=variant, attention_mask=mask, **ARCHITECTURES[arch])


def weighted_logits(model: BeliefLM, tokens: torch.Tensor, weights: torch.Tensor) -> tuple:
    """The logits of `tokens` and the gradients of <logits, weights> (one weight per token
    and vocabulary entry: every logit has its own say in the gradient)."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    (logits * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def packed_against_alone(variant: str, arch: str, mask: str = "document") -> tuple[float, float]:
    """Largest differences (logits; gradients, relative to their norm) between the packed
    window under `mask` and each of its documents run alone through the causal model with
    the same weights (gradients summed over the documents)."""
    model = BeliefLM(model_config(variant, arch, mask), VOCAB, seed=3, eos_id=EOS)
    alone = BeliefLM(model_config(variant, arch, "causal"), VOCAB, seed=3)
    tokens, spans = packed_window()
    weights = torch.randn(16, len(DOCUMENTS), VOCAB, generator=torch.Generator().manual_seed(9))
    packed, packed_grads = weighted_logits(model, tokens, weights)
    summed: dict[str, torch.Tensor] = {}
    logit_error = 0.0
    for row, row_spans in enumerate(spans):
        for span in row_spans:
            logits, grads = weighted_logits(
                alone, tokens[row : row + 1, span], weights[span, row : row + 1]
            )
            error = (logits - packed[span, row : row + 1]).abs().max().item()
            logit_error = max(logit_error, error)
            for name, grad in grads.items():
                summed[name] = summed.get(name, 0) + grad
    assert summed.keys() == packed_grads.keys()
    grad_error = max(
        ((summed[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in packed_grads.items()
    )
    return logit_error, grad_error


KERNEL_CASES = [(v, a, "bins") for v, a in VARIANTS_AND_ARCHITECTURES] + [
    ("attention_bn_sh", "llama", "dense"), ("attention_sh", "gpt2", "dense"),
]  # fmt: skip
"""Every variant by the CPU's kernel, the running statistics by the masked math too."""


@pytest.mark.parametrize(("variant", "arch", "kernel"), KERNEL_CASES)
def test_a_packed_window_computes_each_document_alone(variant, arch, kernel, monkeypatch):
    """Every variant, RoPE and learned positions: logits within fp32 rounding, and the
    gradient of the whole window the sum of its documents' gradients."""
    monkeypatch.setattr(family, "document_kernel", lambda device: kernel)
    logit_error, grad_error = packed_against_alone(variant, arch)
    assert logit_error < 2e-5 and grad_error < 2e-5, (logit_error, grad_error)


@pytest.mark.parametrize(("variant", "arch"), [("attention_bn_sh", "llama"), ("softmax", "gpt2")])
def test_causal_attends_across_documents(variant, arch):
    """The same window under the causal mask: documents see their predecessors (what the
    document mask is for), so the comparison above can fail."""
    logit_error, _ = packed_against_alone(variant, arch, "causal")
    assert logit_error > 1e-2


def without_restart(docs: family.Documents) -> family.Documents:
    """Documents as if the row were one: starts 0, positions 0 .. s-1."""
    index = torch.arange(docs.starts.shape[-1]).expand_as(docs.starts)
    return family.Documents(torch.zeros_like(docs.starts), index)


MUTATIONS = {
    # Attention-BN's μ a running mean over the whole row
    "mean runs on": ("attention_bn", "llama", family, "document_mean",
                     lambda real: lambda x, s, docs: real(x, s, without_restart(docs))),
    # Attention-SH's slots pooled and counted from the row's start
    "pools run on": ("attention_sh", "llama", family, "document_pool",
                     lambda real: lambda x, s, docs: real(x, s, without_restart(docs))),
    # learned positions counted from the row's start (the mask itself right); RoPE's are
    # relative, so there the restart changes only rounding: test_rope_angles_restart
    "learned positions run on": ("softmax", "gpt2", gpt, "documents",
                                 lambda real: lambda ends: real(ends)._replace(
                                     positions=without_restart(real(ends)).positions)),
    # a query also sees the token before its document (the previous document's EOS)
    "mask one early": ("belief", "llama", family, "visible_keys",
                       lambda real: lambda starts, slots=None: real((starts - 1).clamp(0), slots)),
    # a query does not see its document's first token
    "mask one late": ("belief", "llama", family, "visible_keys",
                      lambda real: lambda starts, slots=None: real(starts + 1, slots)
                      | torch.eye(starts.shape[-1], dtype=torch.bool)),
}  # fmt: skip


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutations_are_caught(mutation, monkeypatch):
    """Each way to get documents wrong, applied to the code, fails the comparison (the
    masked math's kernel: the bins kernel runs the causal math on each document alone)."""
    monkeypatch.setattr(family, "document_kernel", lambda device: "dense")
    variant, arch, module, name, mutate = MUTATIONS[mutation]
    assert max(packed_against_alone(variant, arch)) < 2e-5  # right before the mutation
    monkeypatch.setattr(module, name, mutate(getattr(module, name)))
    logit_error, _ = packed_against_alone(variant, arch)
    assert logit_error > 1e-3, logit_error


def test_a_tokenizer_without_eos_is_refused():
    with pytest.raises(BadInput, match=r"attention_mask=document needs the tokenizer's EOS"):
        BeliefLM(model_config("softmax", "llama"), VOCAB, eos_id=-1)  # sentencepiece: none
    BeliefLM(model_config("softmax", "llama", "causal"), VOCAB)  # causal needs none


def test_rope_angles_restart_at_each_document(monkeypatch):
    """RoPE rotates each token by its position in its document. (Scores depend only on
    position differences, so running on would change only rounding: this looks at the
    angles themselves.)"""
    seen = []
    real = gpt.rotary_angles
    monkeypatch.setattr(gpt, "rotary_angles", lambda p, *a: seen.append(p) or real(p, *a))
    tokens, spans = packed_window()
    BeliefLM(model_config("softmax", "llama"), VOCAB, eos_id=EOS)(tokens)
    expected = torch.cat([torch.arange(s.stop - s.start) for s in spans[2]])
    assert len(seen) == SMALL["num_layers"]
    assert all(torch.equal(positions[:, 2], expected) for positions in seen)  # [seq, batch]
