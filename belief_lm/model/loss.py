"""The language-model loss: next-token cross entropy over vocab-parallel logits, in fp32.

Plain (`lm_loss`): the whole micro-batch's logits, copied to fp32, through megatron's
vocab-parallel cross entropy, which keeps the fp32 softmax for backward: 4 bytes per token
and vocabulary row of this rank. At a 128K vocabulary and 8K tokens a micro-batch that is
4 GB, more than the decoder layers of a 1B model keep.

Chunked (`chunked_lm_loss`, train.loss_chunk_tokens): the output GEMM and the cross entropy
together over a few tokens at a time, each chunk recomputed in backward (torch's
checkpoint), so only one chunk's logits, fp32 softmax and logits gradient exist at once and
nothing vocabulary-sized is kept from forward to backward. The same loss and gradients up
to the order of fp32 sums; the price is the output GEMM once more in backward (2 of the
model's 6 x parameters FLOPs per token for the output layer's weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)
from torch import Tensor

IGNORE_INDEX = -100
"""A label not trained on (padding at an epoch's end): torch's ignore_index convention,
the value the data pipeline writes (data_pipeline.loader.IGNORE)."""


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean next-token cross entropy of vocab-parallel logits [seq, batch, vocab / TP]
    against labels [batch, seq], computed in fp32, over the labels that are not
    IGNORE_INDEX (0 if there are none)."""
    labels = labels.t().contiguous()
    losses = vocab_parallel_cross_entropy(logits.float(), labels)
    trained = labels != IGNORE_INDEX
    return (losses * trained).sum() / trained.sum().clamp_min(1)


def chunked_lm_loss(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
    """lm_loss of the logits hidden [seq, batch, hidden] x weight [vocab / TP, hidden]^T,
    computed `chunk_tokens` tokens at a time and recomputed in backward. `hidden` is
    replicated over the tensor-parallel ranks, as for vocab_parallel_logits."""
    # once for all chunks: backward sums hidden's gradient over TP ranks in one all-reduce
    hidden = copy_to_tensor_model_parallel_region(hidden).flatten(0, 1)
    labels = labels.t().reshape(-1)  # token order of `hidden`: sequence-major
    total = hidden.new_zeros((), dtype=torch.float32)
    for part, targets in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens), strict=True):
        # every TP rank runs the same chunks in the same order, so the cross entropy's
        # all-reduces (and their repeats in the recomputation) pair up across ranks;
        # nothing here draws random numbers: no RNG state to keep per chunk
        total = total + torch.utils.checkpoint.checkpoint(
            _summed_loss, part, weight, targets, use_reentrant=False, preserve_rng_state=False
        )
    return total / (labels != IGNORE_INDEX).sum().clamp_min(1)


def _summed_loss(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    """Sum of the cross entropies of one chunk's tokens ([tokens, hidden], [tokens])."""
    losses = vocab_parallel_cross_entropy(F.linear(hidden, weight).float(), labels)
    return (losses * (labels != IGNORE_INDEX)).sum()
