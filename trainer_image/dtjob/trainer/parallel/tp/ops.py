"""The tensor-parallel collectives as autograd functions (Megatron's f and g), and the
vocabulary-parallel cross-entropy. All of them go through a `Comm` (dtjob's collectives)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dtjob.trainer.parallel.comm import Comm


def _summed(comm: Comm, tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.contiguous().clone()
    comm.all_reduce_sum(out)
    return out


class _CopyToTP(torch.autograd.Function):
    """Identity in forward, all-reduce of the gradient in backward: the input of a colwise layer
    (every rank's partial input gradient, from its own output features, is summed)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed(ctx.comm, grad), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce in forward, identity in backward: the partial outputs of a rowwise layer or a
    vocabulary-split embedding."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return _summed(comm, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x if comm.size == 1 else _ReduceFromTP.apply(x, comm)


def vocab_range(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """The rows [lo, hi) of a vocabulary of `vocab` entries that rank `rank` of `size` holds."""
    per = vocab // size
    return rank * per, (rank + 1) * per


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary (the last dimension), without
    gathering them: the row max, the sum of exponentials and the target logit are all-reduced
    (three small tensors of one value per token). The gradient is softmax - one_hot, locally."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, comm: Comm, ignore_index: int
    ) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        lo = comm.rank * local_vocab
        ctx.dtype = logits.dtype
        logits = logits.detach().float()
        # The max over the whole vocabulary, for stability (any value equal on every rank would
        # do): every rank's row maxima gathered.
        local_max = logits.max(dim=-1).values.contiguous()
        maxes = torch.empty(comm.size * local_max.numel(), dtype=local_max.dtype, device=local_max.device)
        comm.all_gather(maxes, local_max.reshape(-1))
        row_max = maxes.view(comm.size, *local_max.shape).max(dim=0).values
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _summed(comm, exp.sum(dim=-1))
        ignored = targets == ignore_index
        mine = (targets >= lo) & (targets < lo + local_vocab) & ~ignored
        local_target = torch.where(mine, targets - lo, torch.zeros_like(targets))
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        target_logit = _summed(comm, target_logit)
        loss = (sum_exp.log() - target_logit) * ~ignored
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, mine, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local_target, mine, ignored = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_target.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g *= (grad * ~ignored).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: dist.ProcessGroup | Comm | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`F.cross_entropy(full_logits.flatten(0, -2), targets.flatten())` from this rank's slice of
    the logits' last (vocabulary) dimension: rank r holds entries [r * V/T, (r + 1) * V/T), what a
    "vocab" LM head of `tensor_parallel` outputs. Every rank of `group` calls it with the same
    targets and gets the same loss. reduction: "mean" (over targets != ignore_index), "sum" or
    "none" (the per-token losses, shaped like targets)."""
    comm = group if isinstance(group, Comm) else Comm("auto", group)
    if logits_shard.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits_shard {tuple(logits_shard.shape)} must be targets' "
            f"shape {tuple(targets.shape)} plus a vocabulary dimension"
        )
    losses = _VocabParallelCE.apply(logits_shard, targets, comm, ignore_index)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / (targets != ignore_index).sum()
    raise ValueError(
        f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"
    )
