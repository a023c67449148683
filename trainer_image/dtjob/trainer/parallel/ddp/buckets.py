"""Gradient buckets: which parameters' gradients travel together in one all-reduce.

Like torch's DDP: parameters are taken in reverse registration order (roughly the order backward
produces their gradients), the first bucket is small (1 MiB) so communication starts as soon as
the last layers are done, the others are capped (25 MiB) to amortise per-message latency while
still overlapping with the rest of backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dtjob.trainer.parallel.comm import Handle

MiB = 1024 * 1024


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # fp32 flat gradients; every param's .grad is a view into it
    offsets: list[int]
    pending: int = 0  # gradients still to arrive in this backward
    handle: Handle | None = None
    wire: torch.Tensor | None = None  # the compressed copy being all-reduced, if any
    ready: bool = False
    launched: bool = False
    grad_views: list[torch.Tensor] = field(default_factory=list)


def assign_buckets(
    params: list[nn.Parameter], first_bucket_bytes: int, bucket_bytes: int
) -> list[list[nn.Parameter]]:
    """Group `params` (already in reverse registration order) into buckets by byte size."""
    if first_bucket_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError("ddp_first_bucket_mb and ddp_bucket_mb must be > 0")
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        cap = first_bucket_bytes if not groups else bucket_bytes
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def make_bucket(index: int, params: list[nn.Parameter]) -> Bucket:
    total = sum(p.numel() for p in params)
    buffer = torch.zeros(total, dtype=params[0].dtype)
    offsets: list[int] = []
    views: list[torch.Tensor] = []
    offset = 0
    for p in params:
        if p.dtype != buffer.dtype:
            raise TypeError(f"DDP bucket mixes dtypes {buffer.dtype} and {p.dtype}; use one parameter dtype")
        offsets.append(offset)
        views.append(buffer[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return Bucket(index=index, params=params, buffer=buffer, offsets=offsets, grad_views=views)
