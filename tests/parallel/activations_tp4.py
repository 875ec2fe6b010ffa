"""torchrun --nproc_per_node=4 tests/parallel/activations_tp4.py OUT

tests/test_plan.py's count of activations at TP=4, as fast_paths.py counts them at TP=2:
the bytes each rank's forward saves for backward at one and two layers, for
fast_paths.ACTIVATION_CASES (every variant with sequence parallelism in fp32 and bf16, two
without) under each recompute mode, saved to OUT.rank<r>."""

import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.parallel.driver import join  # noqa: E402
from tests.parallel.fast_paths import kept_at  # noqa: E402


def main() -> None:
    join(4, 1, timeout_s=120)
    torch.save({"kept": kept_at(4)}, f"{sys.argv[1]}.rank{dist.get_rank()}")


if __name__ == "__main__":
    main()
