"""Gradient buckets: which parameters' gradients travel together in one all-reduce.

As in torch's DDP: parameters are taken in reverse registration order (roughly the order backward
produces their gradients); the first bucket is small (1 MiB) so communication starts as soon as
the last layers are done, the others are capped (25 MiB) to amortise per-message latency while
still overlapping with the rest of backward. A bucket holds one dtype on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dtjob.trainer.parallel.comm import Handle

MiB = 1024 * 1024


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # flat gradients; every param's .grad is a view into it
    grad_views: list[torch.Tensor]
    # The last bucket carries one "has a gradient" flag per parameter of the model after its
    # gradients, summed with them: a parameter no rank produced a gradient for keeps grad None.
    flags: torch.Tensor | None = None
    pending: int = 0  # gradients still to arrive in this backward
    handle: Handle | None = None
    wire: torch.Tensor | None = None  # the compressed copy being all-reduced, if any
    ready: bool = False
    launched: bool = False


def assign_buckets(
    params: list[nn.Parameter], first_bucket_bytes: int, bucket_bytes: int
) -> list[list[nn.Parameter]]:
    """Group `params` (already in reverse registration order) into buckets by byte size, dtype
    and device."""
    if first_bucket_bytes <= 0 or bucket_bytes <= 0:
        raise ValueError("data_parallel: bucket_mb and first_bucket_mb must be > 0")
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        cap = first_bucket_bytes if not groups else bucket_bytes
        nbytes = p.numel() * p.element_size()
        other_kind = bool(current) and (p.dtype, p.device) != (current[0].dtype, current[0].device)
        if current and (size + nbytes > cap or other_kind):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return groups


def make_bucket(index: int, params: list[nn.Parameter], flag_count: int = 0) -> Bucket:
    """A bucket over `params`; `flag_count` > 0 appends that many flag slots after the gradients."""
    total = sum(p.numel() for p in params)
    buffer = torch.zeros(total + flag_count, dtype=params[0].dtype, device=params[0].device)
    views: list[torch.Tensor] = []
    offset = 0
    for p in params:
        views.append(buffer[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    flags = buffer[total:] if flag_count else None
    return Bucket(index=index, params=params, buffer=buffer, grad_views=views, flags=flags)
