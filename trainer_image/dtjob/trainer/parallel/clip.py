"""Gradient norms over sharded parameters: torch.nn.utils.clip_grad_norm_ made to count every rank.

A ZeRO rank (or a pipeline stage) holds only part of the gradients, so the norm of its own
gradients is not the model's. Each gradient a wrapper hands out is marked with the process group
whose ranks together hold the whole model (`mark`); fully_shard's are DTensors, of which the norm
reads the local tensors (torch's own DTensor path would return a DTensor norm and cannot mix with
plain tensors). `install()` replaces the function torch's
`clip_grad_norm_` and `get_total_norm` compute the norm with (torch.nn.utils.clip_grad._get_total_norm,
looked up at call time, so even a `clip_grad_norm_` imported earlier uses it): for marked gradients
it sums the p-th powers over the group (max for p = inf); unmarked gradients (replicated ones, e.g.
DDP's) are counted once, as torch does. A gradient marked `DUPLICATE` (a tied weight's second copy
on another pipeline stage) is clipped but not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as torch_clip
from torch.distributed.tensor import DTensor

from dtjob.trainer.parallel.comm import Comm

_ATTR = "_dtjob_norm_group"
DUPLICATE = "duplicate"
_original = torch_clip._get_total_norm


def mark(grad: torch.Tensor, owner: Comm | str) -> torch.Tensor:
    """Mark `grad` as one piece of a gradient spread over `owner`'s ranks (or DUPLICATE)."""
    setattr(grad, _ATTR, owner)
    return grad


def _p_sum(tensors: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """sum |g|^p over `tensors` (max |g| for p = inf), as one fp64 scalar on their device."""
    norm = _original(tensors, norm_type, False, foreach).double()
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


@torch.no_grad()
def total_norm(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """torch.nn.utils.get_total_norm, over every rank's pieces of marked gradients."""
    given = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    # A DTensor's local tensor carries its mark: a Shard(0) piece is spread over the group, a
    # Replicate() one (unmarked) is counted once, like any replicated gradient.
    listed = [_local(t) for t in given]
    owners = {id(o): o for t in listed if isinstance(o := getattr(t, _ATTR, None), Comm)}
    if not owners:
        counted = [t for t in listed if getattr(t, _ATTR, None) != DUPLICATE]
        return _original(counted, norm_type, error_if_nonfinite, foreach)
    if len(owners) > 1:
        raise ValueError(
            "clip_grad_norm_: the gradients belong to models sharded over different process groups; "
            "clip each model's parameters on their own"
        )
    comm = next(iter(owners.values()))
    norm_type = float(norm_type)
    spread = [t for t in listed if isinstance(getattr(t, _ATTR, None), Comm)]
    local = [t for t in listed if getattr(t, _ATTR, None) is None]
    device = spread[0].device
    total = (
        _p_sum(spread, norm_type, foreach) if spread else torch.zeros((), dtype=torch.float64, device=device)
    )
    total = total.reshape(1)
    inf = math.isinf(norm_type)
    if comm.size > 1:
        # NCCL takes CUDA tensors only, and fully_shard(offload="optimizer")'s gradients are on the
        # host: their norm crosses to the GPU for the all-reduce.
        nccl = dist.get_backend(comm.group) == "nccl"
        reduced = total.cuda() if nccl and device.type != "cuda" else total
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=comm.group)
        total = reduced.to(device)
    if local:
        mine = _p_sum(local, norm_type, foreach).to(device).reshape(1)
        total = torch.maximum(total, mine) if inf else total + mine
    result = (total if inf else total.pow(1.0 / norm_type)).reshape(()).to(spread[0].dtype)
    if error_if_nonfinite and bool(torch.logical_or(result.isnan(), result.isinf())):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped; set error_if_nonfinite=False to scale the gradients by it anyway"
        )
    return result


def _local(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    owner = getattr(t, _ATTR, None)
    if owner is not None:
        setattr(local, _ATTR, owner)
    return local


def install() -> None:
    """Make torch.nn.utils.clip_grad_norm_ and get_total_norm use `total_norm` (idempotent)."""
    torch_clip._get_total_norm = total_norm
    torch.nn.utils.get_total_norm = total_norm


def clip_grad_norm_(parameters: Iterable[Any], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over sharded or plain parameters; returns the total norm."""
    install()
    return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type)
