"""The attention family inside megatron-core's SelfAttention.

megatron's SelfAttention computes Q, K, V (column-parallel: this rank's heads), applies
RoPE, calls a core attention and feeds its output to `linear_proj`. We supply both ends:

- `FamilyCoreAttention` computes H with torch SDPA (flash kernels on GPU, CPU kernels here),
  optionally recentred (Attention-BN) or on pooled keys (Attention-SH), and returns the
  residual signal of the chosen variant (MH, Δ, [Δ, Δ^s] or Φ) for this rank's heads.
- `BeliefStarProjection` maps [Δ, Δ^s] to Δ W^o + Δ^s W^s with ONE all-reduce, keeping W^o
  and W^s separately named and sharded so checkpoints survive a change of TP size; with
  `fused` the two products are one GEMM against [W^o | W^s] (`JointProjection`).

With model.qk_norm, `HeadNorm` is megatron's q_layernorm and k_layernorm: SelfAttention
applies it to each head's queries and keys before RoPE, so before the core (and
Attention-BN's recentring).

The math itself is in `belief_lm/attention.py`; the only process-group code here is the
all-reduce handed to the global projection and the one HeadNorm's weight gradient needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import Tensor

from belief_lm import attention as family
from belief_lm.parallel.collectives import tensor_parallel_sum
from belief_lm.variants import VARIANTS

DECODING: ContextVar[tuple[family.LayerCache, family.DecodeStep] | None] = ContextVar(
    "decoding", default=None
)
"""While a DecoderLayer continues a cached sequence: its layer's cache and the step, for the
one call megatron's SelfAttention makes to the core attention (which has no argument to
hand them over). Read only in evaluation mode."""
CAPTURE: ContextVar[dict | None] = ContextVar("capture", default=None)
"""While set to a dict (belief diagnostics): each layer's core attention stores its MH, V and
largest pre-softmax score (attention.max_logit) there under its layer number. Read only in
evaluation mode."""


class FamilyCoreAttention(MegatronModule):
    """Causal core attention for every variant; a drop-in for megatron's DotProductAttention.

    Inputs are megatron's [seq, batch, heads, head_dim] (query: this rank's heads; key/value:
    its KV groups). Returns [seq, batch, heads * head_dim], or twice that for belief_star.
    Attention is causal over the whole packed window, or, when megatron's attention_mask
    argument carries the window's `attention.Documents` (model.attention_mask=document,
    from the decoder layer), within each document; no other mask is taken.
    In evaluation mode, DECODING makes it attend to the cached tokens too and CAPTURE
    collects MH and V. With `recompute` (selective activation recompute), training keeps
    only Q, K and V and recomputes the rest in backward: SDPA's output and statistics, each
    head's V and the belief projections' intermediates, the layer's largest activations
    per FLOP.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        variant: str,
        gamma: float = 0.5,
        beta: float = 1.0,
        head_scales: Sequence[int] = (),
        fused: bool = False,
        recompute: bool = False,
    ):
        super().__init__(config=config)
        self.layer_number, self.recompute = layer_number, recompute
        self.mixing, self.residual = VARIANTS[variant]
        self.softmax_scale = softmax_scale
        self.gamma, self.beta, self.fused = gamma, beta, fused
        tp_group = pg_collection.tp if pg_collection is not None else None
        self.shard_sum = tensor_parallel_sum(tp_group)
        self.local_head_scales: list[int] = []
        if self.mixing in ("sh", "bn_sh"):
            tp_size, tp_rank = get_pg_size(tp_group), get_pg_rank(tp_group)
            local = config.num_attention_heads // tp_size
            self.local_head_scales = list(head_scales[tp_rank * local : (tp_rank + 1) * local])

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
        **unused,
    ) -> Tensor:
        documents = attention_mask
        if attention_bias is not None or packed_seq_params:
            raise ValueError("FamilyCoreAttention takes no attention bias or packed sequences")
        if documents is not None and not isinstance(documents, family.Documents):
            raise ValueError(
                "FamilyCoreAttention takes no mask tensor: its attention_mask is the "
                "window's attention.Documents (model.attention_mask=document) or None"
            )
        if self.recompute and self.training and torch.is_grad_enabled():
            # torch's checkpoint, not megatron's tensor_parallel.checkpoint: that one saves
            # the CUDA RNG state and fails without CUDA (nothing here draws random numbers).
            # Under TP the recomputation repeats belief's all-reduce on every rank alike.
            return torch.utils.checkpoint.checkpoint(
                self._attend, query, key, value, documents, use_reentrant=False
            )
        return self._attend(query, key, value, documents)

    def _attend(
        self, query: Tensor, key: Tensor, value: Tensor, documents: family.Documents | None
    ) -> Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        cache, step = (None, None) if self.training else (DECODING.get() or (None, None))
        h = family.attention_heads(
            q, k, v, self.mixing, beta=self.beta, head_scales=self.local_head_scales,
            softmax_scale=self.softmax_scale, cache=cache, step=step, documents=documents,
        )  # fmt: skip
        h = h.permute(2, 0, 1, 3)  # [s, b, heads, d]
        if not self.training and (captured := CAPTURE.get()) is not None:
            captured[self.layer_number] = {
                "mh": h.flatten(2).detach(),
                "v": family.heads_from_groups(value, query.shape[2], dim=2).flatten(2).detach(),
                "max_logit": family.max_logit(
                    q,
                    k,
                    self.mixing,
                    beta=self.beta,
                    head_scales=self.local_head_scales,
                    softmax_scale=self.softmax_scale,
                    documents=documents,
                ),
            }
        if self.residual == "mh":  # the heads' outputs as they are: no V_m of each head
            return h.flatten(2)
        v_heads = family.heads_from_groups(value, query.shape[2], dim=2)  # V_m of each head
        return family.residual_signal(
            h, v_heads, self.residual, self.gamma, self.shard_sum, self.fused
        )


class JointProjection(torch.autograd.Function):
    """[Δ, Δ^s] [W^o | W^s]^T as ONE GEMM of depth 2k (k = this rank's head width) instead
    of two of depth k and an add; backward is also one GEMM for the input's gradient, which
    comes out already concatenated (two GEMMs leave two halves to copy together), and one
    for both weights'. The concatenated weight is built per call and rebuilt in backward
    rather than saved: autograd would otherwise hold a copy of W^o and W^s per layer from
    forward to backward."""

    @staticmethod
    def forward(ctx, x: Tensor, w_o: Tensor, w_s: Tensor) -> Tensor:
        ctx.save_for_backward(x, w_o, w_s)
        return F.linear(x, torch.cat((w_o, w_s), dim=1))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, w_o, w_s = ctx.saved_tensors
        grad_x = grad_w_o = grad_w_s = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ torch.cat((w_o, w_s), dim=1)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_w = grad.flatten(0, -2).t() @ x.flatten(0, -2)  # [out, 2k]
            grad_w_o, grad_w_s = grad_w.chunk(2, dim=1)
        return grad_x, grad_w_o, grad_w_s


class BeliefStarProjection(RowParallelLinear):
    """belief_star's output projection Δ W^o + Δ^s W^s, row-parallel over this rank's heads.

    Input is [Δ_r, Δ^s_r] concatenated on the last dim. W^o is `weight` (the name softmax's
    linear_proj uses) and W^s is `w_s.weight`; each is sharded over the same head split, so a
    TP=2 checkpoint merges into a TP=1 one by plain concatenation. The two partial products
    are summed before the single all-reduce (a reduce-scatter over the sequence under
    sequence parallelism, as megatron's W^o does): by two GEMMs and an add, or with `fused`
    (model.fused_output_projection) by one GEMM against [W^o | W^s] (JointProjection): the
    same sum up to rounding, the same parameters.
    """

    def __init__(self, input_size: int, output_size: int, *, fused: bool = False, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.w_s = RowParallelLinear(input_size, output_size, **{**kwargs, "bias": False})
        self.fused = fused

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.fused:
            partial = JointProjection.apply(input_, self.weight, self.w_s.weight)
        else:
            delta, delta_s = input_.chunk(2, dim=-1)
            partial = F.linear(delta, self.weight) + F.linear(delta_s, self.w_s.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        if self.skip_bias_add:
            return output, self.bias
        return (output if self.bias is None else output + self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """W^o as RowParallelLinear does it, and W^s sharded the same way (not replicated)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(self.w_s.sharded_state_dict(f"{prefix}w_s.", sharded_offsets, metadata))
        return state


class HeadNorm(torch.nn.RMSNorm):
    """RMSNorm over each attention head's channels (model.qk_norm, as Qwen3 and OLMo-core's
    per-head QK norm): megatron's SelfAttention builds it as its q_layernorm and
    k_layernorm (hidden_size = head_dim) and applies it to [seq, batch, heads, head_dim]
    before RoPE; one weight of head_dim serves every head.

    Under tensor parallelism each rank holds other heads, so the gradient of the shared
    weight on one rank is only its heads' share: the weight enters the graph through
    megatron's copy to the tensor-parallel region, whose backward sums that gradient over
    the group (megatron sums q/k_layernorm gradients in finalize_model_grads, which
    DeepSpeed does not run). Always RMSNorm, whatever model.normalization is."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)

    def forward(self, heads: Tensor) -> Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight)
        return F.rms_norm(heads, self.normalized_shape, weight, self.eps)


def core_attention_spec(
    variant: str,
    gamma: float,
    beta: float,
    head_scales: Sequence[int],
    fused: bool = False,
    recompute: bool = False,
) -> ModuleSpec:
    """The core-attention entry of megatron's SelfAttention spec for one variant."""
    params = {"variant": variant, "gamma": gamma, "beta": beta, "head_scales": head_scales}
    return ModuleSpec(
        module=FamilyCoreAttention, params={**params, "fused": fused, "recompute": recompute}
    )
