"""The contract between a parallel strategy and the checkpoint code.

Every tensor of the training state (model parameters and buffers, optimizer state) is described
as a *flat shard*: the 1-D slice `[offset, offset + local.numel())` of the tensor flattened in
row-major order. A strategy reports the shards its rank owns; together, the ranks' shards cover
every element of every tensor exactly once (replicated tensors are split between replicas, so no
byte is written twice). Because the format only speaks of global shapes and flat offsets, a
checkpoint written at one world size loads at any other: a loader asks for the global ranges its
new shards need, whatever ranks wrote them.

Keys: "model.<parameter or buffer name>" and "optim.<parameter name>.<state name>" (for example
"optim.blocks.0.attn.qkv.weight.exp_avg"). Non-tensor optimizer state (such as Adam's step
count when it is a Python number) travels in `extra_state()` as plain JSON-serialisable values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class FlatShard:
    """This rank's contiguous slice of one flattened global tensor."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    local: torch.Tensor  # 1-D, contiguous, length may be 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.global_shape:
            n *= d
        return n


# fetch(key, start, length) -> the global flat elements [start, start + length) of tensor `key`.
FetchRange = Callable[[str, int, int], torch.Tensor]


class CheckpointableStrategy(Protocol):
    """What the checkpoint code needs from a parallel strategy (DDP, FSDP/ZeRO, pipeline)."""

    def state_shards(self) -> Mapping[str, FlatShard]:
        """The flat shards this rank owns, covering its part of model and optimizer state."""
        ...

    def extra_state(self) -> dict[str, Any]:
        """JSON-serialisable state identical on every rank (e.g. optimizer step counts)."""
        ...

    def load_state_shards(self, fetch: FetchRange, extra: dict[str, Any]) -> None:
        """Fill this rank's model and optimizer state from a checkpoint, reading via `fetch`."""
        ...
