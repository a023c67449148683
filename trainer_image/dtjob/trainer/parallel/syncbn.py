"""`nn.SyncBatchNorm` under dtjob's wrappers: its statistics reduced over the wrapper's replica
group with the wrapper's own `Comm`.

torch's SyncBatchNorm cannot serve as it is: it refuses CPU tensors (so gloo groups), it syncs
over the whole world unless given a group (under a pipeline, the ranks of other stages never run
that layer: a hang), and it calls torch.distributed itself, beside the wrapper's collectives. So
each wrapper rebinds the forward of every SyncBatchNorm it holds (the instance's, as
common.apply_activation_checkpointing does: names and checkpoints unchanged) to `_forward` below:
per channel the sum, the sum of squares and the count of the local batch, summed over the group
in one all-reduce whose backward sums the gradients over the group too, so autograd gives what one
process gets on the concatenated batch (torch's SyncBatchNorm semantics; eval mode and a group of
one are plain batch norm).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.common import NotSupported


class _SumOverGroup(torch.autograd.Function):
    """all-reduce(SUM) whose gradient is the all-reduce(SUM) of the gradients: each rank's
    output feeds its own loss, and d(sum)/d(input_r) = 1 on every rank."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        out = tensor.clone()
        comm.all_reduce_sum(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        ctx.comm.all_reduce_sum(out)
        return out, None


def _forward(bn: nn.SyncBatchNorm, comm: Comm, x: torch.Tensor) -> torch.Tensor:
    """SyncBatchNorm.forward with the statistics summed over `comm`'s group (torch's
    momentum and num_batches_tracked rules, unbiased running variance over the whole batch)."""
    if x.dim() < 2:
        raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    if not (batch_stats and bn.training) or comm.size == 1:
        keep = not bn.training or bn.track_running_stats
        mean, var = (bn.running_mean, bn.running_var) if keep else (None, None)
        return F.batch_norm(x, mean, var, bn.weight, bn.bias, batch_stats, factor, bn.eps)

    dims = [d for d in range(x.dim()) if d != 1]
    channels = x.shape[1]
    count = x.new_full((1,), x.numel() // channels, dtype=torch.float64)
    # float64 sums: the variance is E[x^2] - E[x]^2, which cancels digits in fp32.
    local = torch.cat([x.sum(dims, dtype=torch.float64), (x * x).sum(dims, dtype=torch.float64), count])
    total = _SumOverGroup.apply(local, comm)
    n = total[-1]
    mean = total[:channels] / n
    var = total[channels : 2 * channels] / n - mean * mean
    shape = [1, channels] + [1] * (x.dim() - 2)
    compute = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    out = (x.to(compute) - mean.to(compute).view(shape)) * torch.rsqrt(var + bn.eps).to(compute).view(shape)
    if bn.weight is not None:
        out = out * bn.weight.view(shape)
    if bn.bias is not None:
        out = out + bn.bias.view(shape)
    if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
        with torch.no_grad():
            unbiased = var.detach() * n / (n - 1).clamp_min(1)
            bn.running_mean.mul_(1 - factor).add_(factor * mean.detach().to(bn.running_mean.dtype))
            bn.running_var.mul_(1 - factor).add_(factor * unbiased.to(bn.running_var.dtype))
    return out.to(x.dtype)


def bind_sync_batchnorms(module: nn.Module, comm: Comm, wrapper: str) -> int:
    """Make every nn.SyncBatchNorm in `module` sync over `comm` (the wrapper's replica group) with
    its collectives; returns how many. A SyncBatchNorm given another process group is refused."""
    ranks = sorted(comm.global_rank(r) for r in range(comm.size))
    bound = 0
    for name, sub in module.named_modules():
        if not isinstance(sub, nn.SyncBatchNorm):
            continue
        group = sub.process_group
        given = None if group is None else sorted(dist.get_process_group_ranks(group))
        if given is not None and given != ranks:
            raise NotSupported(
                f"{wrapper}: SyncBatchNorm {name} syncs over ranks {given}, not over this rank's "
                f"replica group {ranks}; convert with "
                "nn.SyncBatchNorm.convert_sync_batchnorm(model) (no process_group): the wrapper syncs "
                "it over its replica group (a pipeline: the stage's data-parallel group)"
            )
        sub.forward = functools.partial(_forward, sub, comm)  # type: ignore[method-assign]
        bound += 1
    return bound
