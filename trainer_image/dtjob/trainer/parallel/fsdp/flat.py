"""A flat unit: the parameters of one unit, laid end to end and cut into equal shards.

    full   [p0 p0 p0 | p1 p1 | p2 ... | pad]     length padded = size * shard_len
    shard  rank r owns full[r * shard_len : (r + 1) * shard_len]

The module's parameters become views into `full`, so the module runs unchanged. Each rank's
optimizer sees one parameter per original parameter: the piece of it that falls in this rank's
shard (possibly empty), a view into `shard`. So an elementwise optimizer updates exactly its shard,
parameter groups can be chosen by name, and the optimizer state is sharded with no extra copy.

ZeRO-3 keeps `shard` as a tensor of its own and resizes `full`'s storage to zero between uses (the
parameter views stay valid objects; their data comes back when the storage is regrown and filled by
an all-gather). ZeRO-1/2 keep `full` and `shard` is a view of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    name: str  # the parameter's name in the whole model (state dict key)
    param: nn.Parameter  # the full parameter, a view into FlatUnit.full while gathered
    offset: int  # where it starts in the unit's flat buffer
    numel: int
    shape: torch.Size


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls in this rank's shard."""

    slot: Slot
    start: int  # first element of the piece within the flattened parameter
    at: int  # where the piece starts within this rank's shard
    length: int
    param: nn.Parameter  # what the optimizer holds: a view of FlatUnit.shard (grad: of a reduced shard)


class FlatUnit:
    def __init__(
        self, index: int, label: str, named: list[tuple[str, nn.Parameter]], rank: int, size: int, stage: int
    ) -> None:
        self.index = index
        self.label = label  # the unit's module name, for messages ("" for the root)
        self.rank = rank
        self.size = size
        first = named[0][1]
        for name, p in named:
            if (p.dtype, p.device) != (first.dtype, first.device):
                raise TypeError(
                    f"fully_shard: unit {label or '<root>'} mixes {first.dtype} on {first.device} and "
                    f"{p.dtype} on {p.device} ({name}); give its parameters one dtype and device"
                )
        self.dtype, self.device = first.dtype, first.device
        slots: list[Slot] = []
        offset = 0
        for name, p in named:
            slots.append(Slot(name, p, offset, p.numel(), p.shape))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        self.shard_len = -(-offset // size)  # ceil: every rank gets an equal shard
        self.padded = self.shard_len * size
        self.full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for s in slots:
                self.full[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        for s in slots:
            s.param.data = self.full[s.offset : s.offset + s.numel].view(s.shape)
        lo, hi = self.shard_range
        self.shard = self.full[lo:hi].clone() if stage == 3 else self.full[lo:hi]
        self.pieces = [self._piece(s) for s in slots]
        self.gathered = True
        self.grads_pending = len(slots)
        self.synced_version = self.full._version  # ZeRO-1/2: the shard as last gathered

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's [lo, hi) in the flat buffer (may extend into padding)."""
        return self.rank * self.shard_len, (self.rank + 1) * self.shard_len

    def _piece(self, s: Slot) -> ShardPiece:
        lo, hi = self.shard_range
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        start, at, length = (a - s.offset, a - lo, b - a) if a < b else (0, 0, 0)
        param = nn.Parameter(self.shard[at : at + length], requires_grad=True)
        return ShardPiece(s, start, at, length, param)

    def free_full(self) -> None:
        """Release the gathered parameters' memory (ZeRO-3); the views stay, pointing at nothing."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def regrow_full(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.padded * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def flatten_grads(self) -> torch.Tensor:
        """The unit's gradients laid out like `full` (zeros where a parameter got no gradient)."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for s in self.slots:
            if s.param.grad is not None:
                flat[s.offset : s.offset + s.numel].copy_(s.param.grad.reshape(-1))
        return flat

    def add_to_shard_grads(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced shard (length shard_len) to its pieces' gradients, as autograd
        accumulates: a piece whose .grad is None (after zero_grad(set_to_none=True)) takes its view
        of `reduced`. The unit keeps no gradient buffer of its own, so the gradient shard lives from
        the backward to zero_grad(), as in one process and in FSDP2: 4/N bytes per parameter that
        are not held between steps nor during the forward."""
        for piece in self.pieces:
            values = reduced[piece.at : piece.at + piece.length]
            grad = piece.param.grad
            if grad is None:
                piece.param.grad = values
            else:
                grad.add_(values)
