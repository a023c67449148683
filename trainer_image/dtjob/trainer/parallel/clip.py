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
_SPLIT = "_dtjob_split_group"
DUPLICATE = "duplicate"
_original = torch_clip._get_total_norm


def mark(grad: torch.Tensor, owner: Comm | str, split: Comm | None = None) -> torch.Tensor:
    """Mark `grad` as one piece of a gradient spread over `owner`'s ranks (or DUPLICATE); `split`:
    its parameter is itself a tensor_parallel shard, spread over that group too (a wrapper over a
    TP model: fully_shard over the DP group, a pipeline over the stages)."""
    setattr(grad, _ATTR, owner)
    if split is not None:
        setattr(grad, _SPLIT, split)
    return grad


def is_marked(grad: torch.Tensor) -> bool:
    """Whether a wrapper marked `grad` already (its mark, set first, is the one that counts)."""
    return getattr(grad, _ATTR, None) is not None


def mark_split(param: torch.Tensor, tp: Comm) -> None:
    """Record on a tensor_parallel shard the TP group its full parameter is spread over."""
    setattr(param, _SPLIT, tp)


def split_of(param: torch.Tensor) -> Comm | None:
    """The TP group `param` is a shard over (mark_split), else None."""
    split = getattr(param, _SPLIT, None)
    return split if isinstance(split, Comm) else None


def _p_sum(tensors: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """sum |g|^p over `tensors` (max |g| for p = inf), as one fp64 scalar on their device."""
    norm = _original(tensors, norm_type, False, foreach).double()
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


@torch.no_grad()
def _all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType, comm: Comm) -> torch.Tensor:
    """All-reduce `t` over `comm`'s group and return it on its device. NCCL takes CUDA tensors
    only, and fully_shard(offload="optimizer")'s gradients (so their norms) are on the host: they
    cross to the GPU for the all-reduce."""
    nccl = dist.get_backend(comm.group) == "nccl"
    reduced = t.cuda() if nccl and t.device.type != "cuda" else t
    dist.all_reduce(reduced, op=op, group=comm.group)
    return reduced.to(t.device)


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
    inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    splits = {id(s): s for t in spread if isinstance(s := getattr(t, _SPLIT, None), Comm)}
    if len(splits) > 1:
        raise ValueError("clip_grad_norm_: the gradients belong to models split over different TP groups")
    # Pieces of TP shards are summed over the owner's group, then over the TP group; the others
    # (replicated on the TP ranks) over the owner's group only.
    parts = [
        [t for t in spread if getattr(t, _SPLIT, None) is not None],
        [t for t in spread if getattr(t, _SPLIT, None) is None],
    ]
    sums = [
        _p_sum(part, norm_type, foreach) if part else torch.zeros((), dtype=torch.float64, device=device)
        for part in parts
    ]
    both = torch.stack([s.to(device) for s in sums])
    if comm.size > 1:
        both = _all_reduce(both, op, comm)
    if splits:
        split = next(iter(splits.values()))
        if split.size > 1:
            both[:1] = _all_reduce(both[:1].clone(), op, split)
    total = (both.max() if inf else both.sum()).reshape(1)
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
    for attr in (_ATTR, _SPLIT):
        value = getattr(t, attr, None)
        if value is not None:
            setattr(local, attr, value)
    return local


def install() -> None:
    """Make torch.nn.utils.clip_grad_norm_ and get_total_norm use `total_norm` (idempotent)."""
    torch_clip._get_total_norm = total_norm
    torch.nn.utils.get_total_norm = total_norm


def clip_grad_norm_(parameters: Iterable[Any], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over sharded or plain parameters; returns the total norm."""
    install()
    return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type)
