"""torchrun --nproc_per_node=2 tests/parallel/allreduce_backward.py OUT.pt

The global belief projection at TP=2, its inner products summed by (a) our
tensor_parallel_sum and (b) megatron's reduce_from_tensor_model_parallel_region (identity
backward), against the unsharded computation. Saves each rank's gradient slices and the
full reference gradients."""

import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region  # noqa: E402

from belief_lm.attention import global_orthogonal_residual  # noqa: E402
from belief_lm.parallel.collectives import tensor_parallel_sum  # noqa: E402
from tests.parallel.driver import join  # noqa: E402


def grads(mh, v, weight, shard_sum):
    mh, v = mh.clone().requires_grad_(), v.clone().requires_grad_()
    (global_orthogonal_residual(mh, v, shard_sum) * weight).sum().backward()
    return mh.grad, v.grad


def main():
    grid = join(2, 1, timeout_s=60)
    group, rank = grid.tensor_group, grid.layout.tensor_rank
    gen = torch.Generator().manual_seed(0)
    mh, v, weight = (torch.randn(5, 3, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    cols = slice(16 * rank, 16 * (rank + 1))  # this rank's heads
    torch.save(
        {
            "full": grads(mh, v, weight, None),
            "ours": grads(
                mh[..., cols], v[..., cols], weight[..., cols], tensor_parallel_sum(group)
            ),
            "identity_backward": grads(
                mh[..., cols], v[..., cols], weight[..., cols],
                lambda x: reduce_from_tensor_model_parallel_region(x, group=group),
            ),
            "cols": (cols.start, cols.stop),
        },
        f"{sys.argv[1]}.rank{dist.get_rank()}",
    )  # fmt: skip


if __name__ == "__main__":
    main()
