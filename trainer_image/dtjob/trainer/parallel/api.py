"""What the training loop needs from a parallel strategy.

`dtjob.trainer.parallel.parallelize(model, config, ...)` returns an object satisfying
`TrainStrategy`. The model itself knows nothing of parallelism; the strategy wraps it from outside.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dtjob.trainer.parallel.state import CheckpointableStrategy


class TrainStrategy(CheckpointableStrategy, Protocol):
    """One optimizer step at a time over this rank's slice of the global batch."""

    @property
    def data_parallel_rank(self) -> int:
        """Which slice of the global batch this rank reads (pipeline stages of a replica share it)."""
        ...

    @property
    def data_parallel_size(self) -> int:
        """How many slices the global batch is cut into."""
        ...

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and optimizer step on this rank's slice.

        Returns the loss averaged over the whole global batch, identical on every rank.
        """
        ...

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group (the schedule lives in the loop)."""
        ...
