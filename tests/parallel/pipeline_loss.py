"""torchrun --nproc_per_node=2 tests/parallel/pipeline_loss.py OUT

train.loss_chunk_tokens at PP=2: driver.run's steps with the plain and the chunked loss,
for a tied and an untied output layer, and model.compile=layer (each stage's decoder layers
through torch.compile, untied), in one process group (start-up dominates on CPU).
Writes OUT/<tied|untied>-<plain|chunked>-zero1-rank<r>.pt (tests/parallel/conftest.py:
load_run)."""

import sys
import warnings

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from tests.parallel import driver  # noqa: E402

CHUNK = 7
"""Tokens per chunk: a micro-batch's 32 tokens in 5 chunks, the last a short one."""
CASES = {
    f"{tie}-{loss}": (f"model.tie_embeddings={tie == 'tied'}", f"train.loss_chunk_tokens={chunk}")
    for tie in ("tied", "untied")
    for loss, chunk in (("plain", 0), ("chunked", CHUNK))
}
CASES["untied-compiled"] = ("model.tie_embeddings=False", "model.compile=layer")
"""Name: config overrides."""


def main() -> None:
    grid = driver.join(1, 2, timeout_s=120)
    for name, overrides in CASES.items():
        driver.run(grid, sys.argv[1], 1, "belief_star", overrides=overrides, name=name)
    dist.barrier()


if __name__ == "__main__":
    main()
