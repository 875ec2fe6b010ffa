"""The parallel layout as numbers: how a world of processes splits into tensor x pipeline
x data parallelism, and one rank's place in it (torch-free: checked before any process
starts)."""

from __future__ import annotations

from dataclasses import dataclass

from belief_lm.errors import BadInput


@dataclass(frozen=True)
class ParallelDims:
    """How a world of processes is split: tensor x pipeline x data (TP innermost)."""

    world_size: int
    tensor: int
    pipeline: int

    def __post_init__(self) -> None:
        if self.world_size % (self.tensor * self.pipeline):
            raise BadInput(
                f"world size {self.world_size} is not divisible by parallel.tensor "
                f"({self.tensor}) x parallel.pipeline ({self.pipeline})"
            )

    @property
    def data(self) -> int:
        """Data-parallel size: the rest of the world."""
        return self.world_size // (self.tensor * self.pipeline)


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates in the tensor x pipeline x data grid."""

    tensor: int
    pipeline: int
    data: int
    tensor_rank: int
    pipeline_rank: int
    data_rank: int
