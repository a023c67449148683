"""A flat unit: the parameters of one block, laid end to end and cut into equal shards.

    full   [p0 p0 p0 | p1 p1 | p2 ... | pad]     length padded = size * shard_len
    shard  rank r owns full[r * shard_len : (r + 1) * shard_len]

The module's parameters become views into `full`, so the module runs unchanged. Under ZeRO-3,
`full`'s storage is resized to zero between uses (the views stay valid objects; their data comes
back when the storage is regrown and refilled by an all-gather), which is how a rank holds only
its shard between steps without touching the module's code or its parameter objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamSlot:
    name: str  # the parameter's name in the whole model (checkpoint key "model.<name>")
    param: nn.Parameter
    offset: int  # where it starts in the unit's flat buffer
    numel: int
    shape: torch.Size


class FlatUnit:
    def __init__(self, index: int, named: list[tuple[str, nn.Parameter]], rank: int, size: int) -> None:
        self.index = index
        self.rank = rank
        self.size = size
        slots: list[ParamSlot] = []
        offset = 0
        for name, p in named:
            slots.append(ParamSlot(name, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        self.shard_len = -(-offset // size)  # ceil: every rank gets an equal shard
        self.padded = self.shard_len * size
        self.dtype = named[0][1].dtype
        self.full = torch.zeros(self.padded, dtype=self.dtype)
        with torch.no_grad():
            for s in slots:
                self.full[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        for s in slots:
            s.param.data = self.full[s.offset : s.offset + s.numel].view(s.shape)
        self.gathered = True
        self.grads_pending = len(slots)

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's [lo, hi) in the flat buffer (may extend into padding)."""
        return self.rank * self.shard_len, (self.rank + 1) * self.shard_len

    def local_view(self) -> torch.Tensor:
        lo, hi = self.shard_range
        return self.full[lo:hi]

    def free_full(self) -> None:
        """Release the gathered parameters' memory (ZeRO-3); the views stay, pointing at nothing."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def regrow_full(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.padded * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def overlaps(self) -> list[tuple[ParamSlot, int, int, int]]:
        """(slot, start within the parameter, start within this rank's shard, length) per overlap."""
        lo, hi = self.shard_range
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append((s, a - s.offset, a - lo, b - a))
        return out

    def flatten_grads(self) -> torch.Tensor:
        """The unit's gradients laid out like `full` (zeros where a parameter got no gradient)."""
        flat = torch.zeros(self.padded, dtype=torch.float32)
        for s in self.slots:
            if s.param.grad is not None:
                flat[s.offset : s.offset + s.numel].copy_(s.param.grad.reshape(-1))
        return flat
