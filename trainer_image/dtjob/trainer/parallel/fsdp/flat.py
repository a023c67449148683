"""A unit's parameters, each sharded on its first dimension (rows), as torch's FSDP2 does.

Parameter p (rows = p.shape[0]) is cut into N chunks of c_p = ceil(rows / N) rows (torch.chunk's
size); rank r owns rows [r * c_p, (r + 1) * c_p), fewer or none at the end. A rank's shard of the
unit is its chunk of every parameter, end to end, each padded to c_p rows:

    shard of rank r   [p0 rows of r | pad] [p1 rows of r | pad] ...      length shard_len
    all-gather        [shard of rank 0] [shard of rank 1] ...            rank-major, N * shard_len

Why rows and not equal cuts of one flat buffer: the piece the optimizer holds is then a tensor of
the parameter's own dimensionality, (rows it owns, *p.shape[1:]), so shape-based code
(nanoGPT's `p.dim() >= 2` weight-decay groups, LoRA freezing) sees what it sees in one process,
and each piece is still one contiguous range of the flattened parameter (what a checkpoint's
LocalShard describes: start = first row * row numel). The price is padding: up to N - 1 rows per
parameter in the shard, against N - 1 elements per unit before.

The module's parameters stay views into `full`, the unit's parameters end to end in their own
layout, so the module runs unchanged. An all-gather lands in a rank-major buffer and is copied
out into `full` ("copy-out", as FSDP2); gradients are copied into the rank-major layout before a
reduce-scatter ("copy-in"). ZeRO-3 keeps `shard` as a tensor of its own, the pieces are views of
it, and `full`'s storage is resized to zero between uses. ZeRO-1/2 keep `full`, and the pieces
are views of its rows, so the optimizer updates the parameters in place.

Each piece is exposed as torch's FSDP2 exposes it: an nn.Parameter holding a DTensor of the
parameter's global shape, placement Shard(0), on a DeviceMesh of the wrapper's process group, whose
local tensor is the view above; its .grad is a DTensor of the same placement around the reduced
rows. So `p.shape`, `p.dim()` and `named_parameters()` are the unwrapped model's, and torch's
optimizers and clip_grad_norm_ work on them as on FSDP2's. Code needing plain tensors takes
`p.to_local()` (checkpoints do).

A 0-dim parameter cannot be sharded on dim 0: it is replicated (placement Replicate()). It takes one
slot in every rank's shard; every rank copies its gradient into its own slot, so the
reduce-scatter gives each rank the whole sum, and after each gather every rank takes rank 0's
value, so the replicas cannot drift apart by rounding.

Offload (fully_shard(offload="optimizer"), ZeRO-Offload): `host` is this rank's shard in host
memory (pinned when the device is CUDA), and the pieces are views of it, not of the device's
`shard` or `full`: the optimizer the user builds over them keeps its state on the host and steps
there, as with FSDP2's CPUOffloadPolicy. The device keeps `shard` (ZeRO-3) or `full` (ZeRO-1/2)
for the forward; `send_shard()` copies `host` there when the optimizer changed it (its version),
so the updated shards go back before the next forward. A reduced gradient shard is copied to a
host buffer (non_blocking) as its reduce-scatter finishes and the pieces' .grad are views of it;
the wrapper waits for those copies before backward returns. A replicated (0-dim) parameter's host
value takes rank 0's at each gather, as the device's does without offload: the reduce-scatter sums
its gradient in a different order on each rank (1 ulp apart at world 3), so replicas stepped on
their own drift apart.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_post_hook

from dtjob.trainer.device import host_buffer
from dtjob.trainer.parallel.shards import local_tensor

_UNIT = "_dtjob_flat_unit"  # on each piece: a weak reference to its FlatUnit
_hooks: list[Any] = []


@dataclass(frozen=True)
class Slot:
    name: str  # the parameter's name in the whole model (state dict key)
    param: nn.Parameter  # the full parameter, a view into FlatUnit.full while gathered
    offset: int  # where it starts in `full`
    numel: int
    shape: torch.Size
    rows: int  # shape[0] (1 for a 0-dim parameter)
    chunk: int  # rows per rank, ceil(rows / N)
    at: int  # where its chunk starts within every rank's shard

    @property
    def row_numel(self) -> int:
        return self.numel // self.rows if self.rows else 0

    @property
    def replicated(self) -> bool:
        return len(self.shape) == 0

    def rows_of(self, rank: int) -> tuple[int, int]:
        """The rows [first, end) rank `rank` owns (every rank owns a replicated one's)."""
        if self.replicated:
            return 0, 1
        return min(self.rows, rank * self.chunk), min(self.rows, (rank + 1) * self.chunk)

    def piece_shape(self, rank: int) -> tuple[int, ...]:
        first, end = self.rows_of(rank)
        return (end - first, *self.shape[1:]) if self.shape else ()

    def as_dtensor(self, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """`local` (this rank's rows, shaped piece_shape) as a view of the global parameter."""
        placements = [Replicate()] if self.replicated else [Shard(0)]
        return DTensor.from_local(
            local, mesh, placements, shape=self.shape, stride=self.stride, run_check=False
        )

    @property
    def stride(self) -> tuple[int, ...]:
        """The global parameter's (contiguous) stride."""
        out, step = [], 1
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))


@dataclass(frozen=True)
class ShardPiece:
    """The rows of one parameter this rank owns."""

    slot: Slot
    start: int  # first element of the piece within the flattened parameter
    at: int  # where the piece starts within this rank's shard
    length: int  # elements
    local: torch.Tensor  # this rank's rows, (rows owned, *shape[1:]): a view of the shard or `full`
    param: nn.Parameter  # what the optimizer holds: a DTensor of the global shape around `local`


class FlatUnit:
    def __init__(
        self,
        index: int,
        label: str,
        named: list[tuple[str, nn.Parameter]],
        mesh: DeviceMesh,
        rank: int,
        size: int,
        stage: int,
        offload: bool = False,
    ) -> None:
        self.index = index
        self.label = label  # the unit's module name, for messages ("" for the root)
        self.rank = rank
        self.size = size
        self.mesh = mesh
        first = named[0][1]
        for name, p in named:
            if (p.dtype, p.device) != (first.dtype, first.device):
                raise TypeError(
                    f"fully_shard: unit {label or '<root>'} mixes {first.dtype} on {first.device} and "
                    f"{p.dtype} on {p.device} ({name}); give its parameters one dtype and device"
                )
        self.dtype, self.device = first.dtype, first.device
        slots: list[Slot] = []
        offset = at = 0
        for name, p in named:
            rows = p.shape[0] if p.dim() > 0 else 1
            chunk = -(-rows // size)
            slots.append(Slot(name, p, offset, p.numel(), p.shape, rows, chunk, at))
            offset += p.numel()
            at += chunk * (p.numel() // rows if rows else 0)
        self.slots = slots
        self.numel = offset
        self.shard_len = at
        self.padded = self.shard_len * size  # what an all-gather returns
        self.full = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for s in slots:
                self.full[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        for s in slots:
            s.param.data = self.full[s.offset : s.offset + s.numel].view(s.shape)
        self.shard = self.local_shard() if stage == 3 else None
        self.host: torch.Tensor | None = None  # offload: the optimizer's shard, in host memory
        if offload:
            on_device = self.send_shard_on_device()
            self.host = host_buffer(on_device).copy_(on_device)
        self.pieces = [self._piece(s) for s in slots]
        self.gathered = True
        self.grads_pending = len(slots)
        self.synced_version = self.version()  # ZeRO-1/2: the pieces as last gathered
        for piece in self.pieces:
            setattr(piece.param, _UNIT, weakref.ref(self))
        if not _hooks:
            _hooks.append(register_optimizer_step_post_hook(_mark_stepped))

    def version(self) -> int:
        """Changes when the parameters or the pieces change in place (ZeRO-1/2 then gathers).
        An op on a DTensor bumps the DTensor's version counter but not its local tensor's, and
        torch's foreach optimizers bump neither: an optimizer step marks its units (_mark_stepped)."""
        base = self.host if self.host is not None else self.full
        return base._version + sum(p.param._version for p in self.pieces)

    def mark_stale(self) -> None:
        self.synced_version = -1

    def _piece(self, s: Slot) -> ShardPiece:
        first, end = s.rows_of(self.rank)
        start, length = first * s.row_numel, (end - first) * s.row_numel
        shape = s.piece_shape(self.rank)
        if self.host is not None:  # offload: a view of the host shard
            data = self.host[s.at : s.at + length].view(shape)
        elif self.shard is not None:  # ZeRO-3: a view of the shard
            data = self.shard[s.at : s.at + length].view(shape)
        else:  # ZeRO-1/2: a view of the parameter's own rows
            data = self.full[s.offset + start : s.offset + start + length].view(shape)
        param = nn.Parameter(s.as_dtensor(data, self.mesh), requires_grad=True)
        return ShardPiece(s, start, s.at, length, data, param)

    def _rank_ranges(self, s: Slot, reading: bool = False) -> Iterator[tuple[int, int, int]]:
        """(rank, start, length): rank's rows of `s` as elements of the flattened parameter.
        reading: a replicated parameter is read from rank 0's slot only."""
        for r in range(1 if reading and s.replicated else self.size):
            first, end = s.rows_of(r)
            if end > first:
                yield r, first * s.row_numel, (end - first) * s.row_numel

    def send_shard(self) -> torch.Tensor:
        """What this rank gives an all-gather, on the device: the ZeRO-3 shard, or (ZeRO-1/2) a copy
        of its rows. Offload: the host shard, copied to the device if the optimizer changed it."""
        if self.host is None:
            return self.send_shard_on_device()
        if self.shard is None:  # ZeRO-1/2: called once per optimizer step (the unit is stale)
            return self.host.to(self.device, non_blocking=True)
        if self.synced_version != self.version():
            self.shard.copy_(self.host, non_blocking=True)
            self.synced_version = self.version()
        return self.shard

    def send_shard_on_device(self) -> torch.Tensor:
        return self.shard if self.shard is not None else self.local_shard()

    def local_shard(self) -> torch.Tensor:
        """This rank's shard (padded rows zero) copied out of `full`."""
        shard = torch.zeros(self.shard_len, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for s in self.slots:
                first, end = s.rows_of(self.rank)
                n = (end - first) * s.row_numel
                lo = s.offset + first * s.row_numel
                shard[s.at : s.at + n].copy_(self.full[lo : lo + n])
        return shard

    def copy_out(self, gathered: torch.Tensor, full: torch.Tensor) -> None:
        """Copy a rank-major all-gather result into `full`'s layout (each parameter end to end)."""
        dsts, srcs = [], []
        for s in self.slots:
            for r, start, length in self._rank_ranges(s, reading=True):
                src = r * self.shard_len + s.at
                dsts.append(full[s.offset + start : s.offset + start + length])
                srcs.append(gathered[src : src + length])
            if s.replicated and self.shard is not None:  # every rank keeps rank 0's value
                dsts.append(self.shard[s.at : s.at + 1])
                srcs.append(gathered[s.at : s.at + 1])
        _copy_all(dsts, srcs)
        if self.host is not None:
            self._replicas_from_rank0(gathered)

    def _replicas_from_rank0(self, gathered: torch.Tensor) -> None:
        """Offload: the host copy of each replicated parameter takes rank 0's value too (the
        device's already has it: it stays in sync with the host if it was)."""
        assert self.host is not None
        synced = self.synced_version == self.version()
        with torch.no_grad():
            for s in self.slots:
                if s.replicated:
                    self.host[s.at : s.at + 1].copy_(gathered[s.at : s.at + 1])  # 0-dim: tiny
        if synced:
            self.synced_version = self.version()

    def free_full(self) -> None:
        """Release the gathered parameters' memory (ZeRO-3); the views stay, pointing at nothing."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def regrow_full(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.numel * self.full.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def flatten_grads(self) -> torch.Tensor:
        """The unit's gradients in the rank-major layout a reduce-scatter cuts into shards (zeros
        where a parameter got no gradient, and in the padding)."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        dsts, srcs = [], []
        for s in self.slots:
            if s.param.grad is None:
                continue
            grad = s.param.grad.reshape(-1)
            for r, start, length in self._rank_ranges(s):
                dst = r * self.shard_len + s.at
                dsts.append(flat[dst : dst + length])
                srcs.append(grad[start : start + length])
        _copy_all(dsts, srcs)
        return flat

    def add_to_shard_grads(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced shard (length shard_len) to its pieces' gradients, as autograd
        accumulates: a piece whose .grad is None (after zero_grad(set_to_none=True)) takes its view
        of `reduced`. The unit keeps no gradient buffer of its own, so the gradient shard lives from
        the backward to zero_grad(), as in one process and in FSDP2: 4/N bytes per parameter (and
        the rows' padding) that are not held between steps nor during the forward.
        Offload: the shard is copied to the host first; non_blocking where no piece has a gradient
        to add it to (the wrapper waits for it before backward returns)."""
        if self.host is not None:
            fresh = all(p.param.grad is None for p in self.pieces)
            host = host_buffer(reduced)
            reduced = host.copy_(reduced, non_blocking=fresh)
        for piece in self.pieces:
            values = reduced[piece.at : piece.at + piece.length].view(piece.local.shape)
            grad = piece.param.grad
            if grad is None:
                piece.param.grad = piece.slot.as_dtensor(values, self.mesh)
            else:
                local_tensor(grad).add_(values)


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair, in one foreach call (N ranges per parameter: one kernel
    launch per unit on a GPU, not N per parameter)."""
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)


def _mark_stepped(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """After any optimizer's step (a global post-hook): the units of the pieces it holds are stale."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, _UNIT, None)
            unit = ref() if ref is not None else None
            if unit is not None:
                unit.mark_stale()
