"""The loss and its z-loss (train.z_loss) against a float64 computation of their
definitions, whole and a chunk of tokens at a time, and through the model; TP=2 is
tests/parallel/test_equivalence.py's (test_qk_norm_and_z_loss_tp2)."""

import pytest
import torch

from belief_lm.model.gpt import BeliefLM
from belief_lm.model.loss import IGNORE_INDEX, chunked_lm_loss, lm_loss
from tests.models import tiny_model

pytestmark = pytest.mark.usefixtures("single_process_group")

SEQ, BATCH, HIDDEN, VOCAB = 12, 3, 16, 50
Z = 0.1
"""A z-loss coefficient large enough that its share of the gradient shows."""


def reference(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple:
    """In float64, from the definitions: the mean cross entropy over the trained labels and
    z_loss x their mean squared log-sum-exp (differentiable)."""
    logits = logits.double()
    targets = labels.t()  # [seq, batch], as the logits
    trained = targets != IGNORE_INDEX
    log_sum_exp = logits.logsumexp(-1)
    picked = logits.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    count = trained.sum()
    cross_entropy = ((log_sum_exp - picked) * trained).sum() / count
    return cross_entropy, z_loss * (log_sum_exp.square() * trained).sum() / count


def objective_gradient(logits: torch.Tensor, labels: torch.Tensor, z_loss: float) -> tuple:
    """reference's two terms and the gradient of their sum over the logits (float64)."""
    logits = logits.detach().double().requires_grad_()
    cross_entropy, z = reference(logits, labels, z_loss)
    (cross_entropy + z).backward()
    return cross_entropy.detach(), z.detach(), logits.grad


def data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [seq, batch, hidden], weight [vocab, hidden] (logits of a few units: their
    log-sum-exp is far from 0) and labels [batch, seq] with some ignored."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.8 + 0.3
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[1, 7:] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("z_loss", [0.0, Z])
def test_loss_and_z_loss_are_their_definitions(z_loss):
    """lm_loss: its value the cross entropy, its z_loss the z-loss term, its gradient that
    of their sum (float64 reference, to fp32 rounding)."""
    hidden, weight, labels = data()
    logits = (hidden @ weight.t()).requires_grad_()
    cross_entropy, z, grad = objective_gradient(logits, labels, z_loss)
    terms = lm_loss(logits.clone(), labels, z_loss)  # (it works on its input in place)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(cross_entropy.item(), rel=1e-6)
    assert terms.z_loss.item() == pytest.approx(z.item(), rel=1e-6)
    assert not terms.z_loss.requires_grad
    torch.testing.assert_close(logits.grad, grad.float(), rtol=1e-5, atol=1e-7)
    if z_loss:
        assert z.item() > 0.1 * cross_entropy.item()  # a share that shows in the gradient
        _, _, without = objective_gradient(logits, labels, 0.0)
        assert (grad - without).abs().max() > 1e-3


@pytest.mark.parametrize("chunk", [SEQ * BATCH, 7, 5])
def test_chunked_loss_and_z_loss_are_their_definitions(chunk):
    """chunked_lm_loss (chunks that do not divide the 36 tokens, cutting a position's batch
    rows apart): the same value, z-loss and gradients of hidden and weight."""
    hidden, weight, labels = data(1)
    hidden.requires_grad_(), weight.requires_grad_()
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    cross_entropy, z = reference(hidden64 @ weight64.t(), labels, Z)
    (cross_entropy + z).backward()
    terms = chunked_lm_loss(hidden, weight, labels, chunk, Z)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(cross_entropy.item(), rel=1e-6)
    assert terms.z_loss.item() == pytest.approx(z.item(), rel=1e-6)
    torch.testing.assert_close(hidden.grad, hidden64.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, weight64.grad.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 23])
def test_the_model_reports_its_z_loss(chunk):
    """BeliefLM with train.z_loss: the same loss value as without (the cross entropy), its
    z-loss term in get_additional_losses (DeepSpeed's hook), other gradients; none without."""
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    runs = {}
    for z_loss in (0.0, Z):
        model = BeliefLM(tiny_model("softmax"), 256, seed=3, loss_chunk_tokens=chunk, z_loss=z_loss)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        runs[z_loss] = loss.item(), model.get_additional_losses(), model.embedding.word_embeddings
    assert runs[Z][0] == runs[0.0][0]
    assert runs[0.0][1] is None
    logits = BeliefLM(tiny_model("softmax"), 256, seed=3)(tokens[:, :-1]).detach()
    _, z = reference(logits, tokens[:, 1:], Z)
    assert runs[Z][1]["z_loss"].item() == pytest.approx(z.item(), rel=1e-5)
    embedding_grads = [runs[z][2].weight.grad for z in (0.0, Z)]
    assert not torch.allclose(*embedding_grads, atol=1e-6)
