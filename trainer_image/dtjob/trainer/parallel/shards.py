"""How a wrapped model's state maps onto global tensors: what a checkpoint writes and reads.

Every tensor of the training state (a parameter, a buffer, an optimizer state shaped like its
parameter) is a *global tensor* named as in the unwrapped model: "model.<name>" and
"optim.<name>.<state>" (for example "optim.transformer.h.0.attn.c_attn.weight.exp_avg"). A rank
holds a *local tensor*: the flat range [offset, offset + numel) of the global tensor flattened in
row-major order (the whole tensor for DDP, a contiguous piece of it for ZeRO). Several ranks may
hold the same range (replicas); each writes only its `write` part of it, so the ranks' writes cover
every element exactly once. A checkpoint written at one world size loads at any other: a loader
asks for the global ranges its own local tensors need, whatever ranks wrote them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor


def split_range(numel: int, replica: int, replicas: int) -> tuple[int, int]:
    """The flat range [lo, hi) of a replicated tensor that replica `replica` of `replicas` writes."""
    chunk = -(-numel // replicas)
    lo = min(numel, replica * chunk)
    return lo, min(numel, lo + chunk)


@dataclass(frozen=True)
class LocalShard:
    """One local tensor and where it sits in its global tensor."""

    name: str  # in the unwrapped model (state_dict key)
    tensor: torch.Tensor  # for a parameter: the object the optimizer holds (fully_shard: a DTensor)
    global_shape: tuple[int, ...]
    offset: int  # flat position of tensor's first element in the global tensor
    write: tuple[int, int]  # the part [lo, hi) of tensor.view(-1) this rank writes

    @classmethod
    def replicated(cls, name: str, tensor: torch.Tensor, replica: int, replicas: int) -> LocalShard:
        """A whole tensor that `replicas` ranks hold alike; replica `replica` writes its split."""
        return cls(name, tensor, tuple(tensor.shape), 0, split_range(tensor.numel(), replica, replicas))

    @classmethod
    def from_replica0(cls, name: str, tensor: torch.Tensor, replica: int) -> LocalShard:
        """A whole tensor that replicas may hold differently (a buffer such as BatchNorm's running
        statistics, updated by each rank's own batches): replica 0 writes all of it, so a
        checkpoint holds one rank's values, those the next forward would broadcast."""
        return cls(name, tensor, tuple(tensor.shape), 0, (0, tensor.numel() if replica == 0 else 0))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor`: a DTensor's local tensor (a view: writing it writes the
    DTensor), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class FlatShard:
    """This rank's contiguous slice of one flattened global tensor, as a checkpoint file holds it."""

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


class Sharded(Protocol):
    """What dtjob's wrappers (data_parallel, fully_shard, pipeline) tell the checkpoint code."""

    def local_shards(self) -> list[LocalShard]:
        """This rank's trainable parameters (the tensors its optimizer holds), in a fixed order."""
        ...

    def local_buffers(self) -> list[LocalShard]:
        """This rank's persistent buffers; replica 0 of each replica group writes them."""
        ...

    def after_load(self) -> None:
        """Called once local tensors were overwritten from a checkpoint (e.g. to re-gather)."""
        ...
