"""The language-model loss: next-token cross entropy over vocab-parallel logits, in fp32,
and the optional z-loss (train.z_loss) from the same log-sum-exp.

Plain (`lm_loss`): the whole micro-batch's logits, copied to fp32, through the
vocab-parallel cross entropy, which keeps the fp32 softmax for backward: 4 bytes per token
and vocabulary row of this rank. At a 128K vocabulary and 8K tokens a micro-batch that is
4 GB, more than the decoder layers of a 1B model keep.

Chunked (`chunked_lm_loss`, train.loss_chunk_tokens): the output GEMM and the cross entropy
together over a few tokens at a time, each chunk recomputed in backward (torch's
checkpoint), so only one chunk's logits, fp32 softmax and logits gradient exist at once and
nothing vocabulary-sized is kept from forward to backward. The same loss and gradients up
to the order of fp32 sums; the price is the output GEMM once more in backward (2 of the
model's 6 x parameters FLOPs per token for the output layer's weights).

The z-loss (PaLM; OLMo's `z_loss_multiplier`) is train.z_loss x the mean over the trained
tokens of log(sum over the whole vocabulary of exp(logits))^2. That log-sum-exp is the
cross entropy's own: megatron's vocab-parallel cross entropy all-reduces each token's
maximum and sum of exponentials over the tensor-parallel group, and `CrossEntropyAndLogSumExp`
returns the log-sum-exp it makes of them beside the cross entropy, so the z-loss needs no
collective of its own and is exact under tensor parallelism and chunking alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility
from torch import Tensor

from belief_lm.parallel.collectives import TensorParallelPlace, all_reduce_unless_alone

IGNORE_INDEX = -100
"""A label not trained on (padding at an epoch's end): torch's ignore_index convention,
the value the data pipeline writes (data_pipeline.loader.IGNORE)."""


class LossTerms(NamedTuple):
    """A micro-batch's loss, and the z-loss inside its gradient."""

    loss: Tensor
    """The mean cross entropy over the trained tokens. Its gradient is that of the
    objective, loss + z_loss; its value stays the cross entropy, so losses of runs with and
    without a z-loss compare (and spikes are judged on the cross entropy)."""
    z_loss: Tensor
    """The z-loss term, train.z_loss x the mean squared log-sum-exp (detached: reported
    beside the loss); 0 without a z-loss."""


class CrossEntropyAndLogSumExp(torch.autograd.Function):
    """Per token of vocab-parallel logits [..., vocab / TP] and targets [...]: the cross
    entropy and the log-sum-exp of the logits over the whole vocabulary.

    megatron's vocab-parallel cross entropy (its VocabParallelCrossEntropy steps, its
    in-place use of the logits), with the log-sum-exp kept: the maximum and the sum of
    exponentials, all-reduced over the tensor-parallel group once each, give both. Backward
    makes one gradient of both: softmax x (g_ce + g_lse) - one-hot(target) x g_ce; without
    a gradient for the log-sum-exp it is megatron's own backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        steps, place = VocabParallelCrossEntropy, TensorParallelPlace.here()
        group = place.group
        logits, logits_max = steps.calculate_logits_max(logits)
        all_reduce_unless_alone(logits_max, dist.ReduceOp.MAX, group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.shape[-1], place.rank, place.size
        )
        target_mask, masked_target, predicted, sum_exp, exp_logits = (
            steps.calculate_predicted_logits(logits, target, logits_max, start, end)
        )
        sums = torch.stack((predicted, sum_exp))  # both summed over the shards at once
        all_reduce_unless_alone(sums, group=group)
        predicted, sum_exp = sums
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target)
        ctx.set_materialize_grads(False)
        return loss, sum_exp.log() + logits_max

    @staticmethod
    def backward(ctx, grad_loss: Tensor | None, grad_lse: Tensor | None):
        softmax, target_mask, masked_target = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, rows, not_elsewhere, grad = steps.prepare_gradient_calculation_operands(
            softmax, target_mask
        )
        if grad_lse is None:  # the cross entropy alone
            args = (grad_2d, rows, masked_target, not_elsewhere, grad, grad_loss)
            return steps.calculate_gradients(*args), None
        if grad_loss is None:
            grad_loss = torch.zeros_like(grad_lse)
        grad.mul_((grad_loss + grad_lse).unsqueeze(-1))
        grad_2d[rows, masked_target] -= not_elsewhere * grad_loss.reshape(-1)
        return grad, None


def tensor_parallel_input(hidden: Tensor, sequence_parallel: bool = False) -> Tensor:
    """The output layer's input [seq, batch, hidden], the whole sequence on every
    tensor-parallel rank. Replicated (`hidden` itself): its gradient is summed over the ranks
    in backward (megatron's copy to the TP region). Under sequence parallelism `hidden` is
    this rank's [seq / TP, batch, hidden]: all-gathered, its gradient reduce-scattered."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=TensorParallelPlace.here().group
        )
    return copy_to_tensor_model_parallel_region(hidden)


def lm_loss(logits: Tensor, labels: Tensor, z_loss: float = 0.0) -> LossTerms:
    """The mean next-token cross entropy of vocab-parallel logits [seq, batch, vocab / TP]
    against labels [batch, seq], computed in fp32, over the labels that are not
    IGNORE_INDEX (0 if there are none), and the z-loss with coefficient `z_loss`."""
    labels = labels.t().contiguous()
    losses, log_sum_exp = CrossEntropyAndLogSumExp.apply(logits.float(), labels)
    trained = labels != IGNORE_INDEX
    squared = (log_sum_exp.square() * trained).sum() if z_loss else None
    return _terms((losses * trained).sum(), squared, trained.sum(), z_loss)


def chunked_lm_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_tokens: int,
    z_loss: float = 0.0,
    sequence_parallel: bool = False,
) -> LossTerms:
    """lm_loss of the logits hidden [seq, batch, hidden] x weight [vocab / TP, hidden]^T,
    computed `chunk_tokens` tokens at a time and recomputed in backward. `hidden` is
    replicated over the tensor-parallel ranks, or with `sequence_parallel` this rank's
    [seq / TP, batch, hidden] (tensor_parallel_input)."""
    # once for all chunks: one all-reduce (or reduce-scatter) of hidden's gradient
    hidden = tensor_parallel_input(hidden, sequence_parallel).flatten(0, 1)
    labels = labels.t().reshape(-1)  # token order of `hidden`: sequence-major
    sums = hidden.new_zeros(2, dtype=torch.float32)
    for part, targets in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens), strict=True):
        # every TP rank runs the same chunks in the same order, so the cross entropy's
        # all-reduces (and their repeats in the recomputation) pair up across ranks;
        # nothing here draws random numbers: no RNG state to keep per chunk
        sums = sums + torch.utils.checkpoint.checkpoint(
            _summed_terms, part, weight, targets, bool(z_loss), use_reentrant=False,
            preserve_rng_state=False,
        )  # fmt: skip
    trained = (labels != IGNORE_INDEX).sum()
    return _terms(sums[0], sums[1] if z_loss else None, trained, z_loss)


def _summed_terms(hidden: Tensor, weight: Tensor, labels: Tensor, squares: bool) -> Tensor:
    """[the sum of the cross entropies, of the squared log-sum-exps (with `squares`, else
    0)] of one chunk's tokens ([tokens, hidden], [tokens])."""
    losses, log_sum_exp = CrossEntropyAndLogSumExp.apply(F.linear(hidden, weight).float(), labels)
    trained = labels != IGNORE_INDEX
    squared = (log_sum_exp.square() * trained).sum() if squares else losses.new_zeros(())
    return torch.stack(((losses * trained).sum(), squared))


def _terms(
    cross_entropy: Tensor, squared_lse: Tensor | None, trained: Tensor, z_loss: float
) -> LossTerms:
    """LossTerms from the sums over the trained tokens (`trained` of them)."""
    count = trained.clamp_min(1)
    loss = cross_entropy / count
    if squared_lse is None:
        return LossTerms(loss, loss.detach().new_zeros(()))
    z = z_loss * squared_lse / count
    # the objective's gradient with the cross entropy's value: z - z.detach() is exactly 0
    return LossTerms(loss + (z - z.detach()), z.detach())
