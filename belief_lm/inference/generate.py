"""Text generation with our own model: next-token sampling and the decoding loop.

Sampling follows the usual order: temperature, then top-k, then top-p (nucleus), then a
draw; temperature 0 is greedy decoding (argmax). BeliefLM decodes with a cache (every
attention variant's: belief_lm.attention.DecodeCache): the prompt is run once, then each
step feeds only the new token. Past the context length (model.seq_length) every step reruns
the model over the cropped context instead, as without the cache: the crop moves every
position by one each step, so nothing cached stays valid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from belief_lm.errors import BadInput


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen."""

    temperature: float = 1.0
    """Divides the logits; 0 means greedy (argmax)."""
    top_k: int | None = None
    """Keep only the k most likely tokens; None: all."""
    top_p: float | None = None
    """Keep the smallest set of most likely tokens whose probability reaches p; None: all."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise BadInput(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise BadInput(f"top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise BadInput(f"top-p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """`logits` [..., vocab] with every token outside the top-k / top-p set at -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        # scatter the k best rather than compare with the k-th value: ties keep exactly k
        values, indices = logits.topk(top_k, dim=-1)
        logits = torch.full_like(logits, -torch.inf).scatter(-1, indices, values)
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # a token stays if the tokens ranked above it have not reached p yet (the first
        # always stays): the smallest prefix whose probability reaches p
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, -torch.inf)
        logits = torch.empty_like(logits).scatter(-1, order, sorted_logits)
    return logits


def next_token(
    logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None
) -> Tensor:
    """One token id per row of `logits` [batch, vocab] (int64 [batch])."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    *,
    context_length: int,
    vocab_size: int,
    eos_id: int | None = None,
    seed: int = 0,
    stop: Callable[[list[int]], bool] | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Continue `prompt` (token ids) with at most `max_new_tokens` ids, stopping before EOS
    or once `stop(new ids so far)` is true (e.g. a stop string was decoded).

    `model` maps tokens [batch, seq] to logits [seq, batch, vocab'] (BeliefLM); it sees
    at most the last `context_length` tokens. With `use_cache` and a model that has
    `decode_cache()` (BeliefLM), it decodes with that cache while the sequence fits in the
    context. Logits past `vocab_size` (the tokenizer's vocabulary; the embedding is padded
    beyond it) are never chosen. The same seed gives the same tokens.
    """
    if not prompt:
        raise BadInput("the prompt is empty: give at least one token")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    ids = list(prompt)
    cache = model.decode_cache() if use_cache and hasattr(model, "decode_cache") else None
    cached = 0  # how many of `ids` the cache holds
    for _ in range(max_new_tokens):
        if cache is not None and len(ids) <= context_length:
            logits = model(torch.tensor([ids[cached:]], device=device), cache=cache)
            cached = len(ids)
        else:  # the whole (cropped) context
            logits = model(torch.tensor([ids[-context_length:]], device=device))
        token = int(next_token(logits[-1, :, :vocab_size], sampling, generator))  # host sync
        if token == eos_id:
            break
        ids.append(token)
        if stop is not None and stop(ids[len(prompt) :]):
            break
    return ids[len(prompt) :]
