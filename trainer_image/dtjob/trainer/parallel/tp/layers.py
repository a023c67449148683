"""Splitting one module in place for tensor parallelism: its parameters become this rank's
shards (same names, local shapes) and its forward runs on them with the plan's collectives.

Kinds (values of a plan):
- "colwise": nn.Linear / transformers' Conv1D with its output features split (and its bias):
  the input is replicated, the output holds this rank's features (Megatron's ColumnParallelLinear).
- "colwise_qkv": colwise for a fused q/k/v projection (GPT-2's c_attn): each of its three thirds
  is split, so every rank holds the q, k and v of the same heads.
- "rowwise": input features split; the partial outputs are all-reduced in forward, the bias added
  once after (RowParallelLinear). Its input is a colwise layer's local output.
- "vocab": an nn.Embedding split over the vocabulary (masked lookup, all-reduced), or an LM head
  (nn.Linear) split over its output (vocabulary) rows, whose logits stay split: the loss is
  `vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.tp.ops import copy_to_tp, reduce_from_tp, vocab_range

KINDS = ("colwise", "colwise_qkv", "rowwise", "vocab")


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter is cut from its full tensor: along `dim`, in `parts` equal blocks
    (3 for a fused q/k/v), each block split into `comm.size` pieces, this rank taking piece rank."""

    dim: int
    parts: int
    full_shape: tuple[int, ...]


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D: an nn.Linear with its weight transposed, (in_features, out_features)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def cut(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of `full` under `spec`."""
    blocks = full.chunk(spec.parts, spec.dim)
    return torch.cat([b.chunk(size, spec.dim)[rank] for b in blocks], spec.dim).contiguous()


def join(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's shard (the inverse of `cut`)."""
    per_rank = [p.chunk(spec.parts, spec.dim) for p in pieces]
    return torch.cat([per_rank[r][b] for b in range(spec.parts) for r in range(len(pieces))], spec.dim)


class Sharder:
    """Replaces parameters by their shards, once per parameter object (a weight tied between
    modules, GPT-2's wte and lm_head, becomes one shared shard); `specs` maps id(shard) -> spec."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.specs: dict[int, ShardSpec] = {}
        self._done: dict[int, nn.Parameter] = {}
        self._names: dict[int, str] = {}  # id(full parameter) -> where it was first split

    def shard(self, module: nn.Module, attr: str, dim: int, parts: int, where: str) -> None:
        full = getattr(module, attr)
        if full is None:
            return
        if id(full) in self._done:
            setattr(module, attr, self._done[id(full)])
            return
        size = full.shape[dim]
        if size % (parts * self.comm.size):
            what = f"{parts} blocks of " if parts > 1 else ""
            raise ValueError(
                f"tensor_parallel: {where}.{attr} has {size} {'rows' if dim == 0 else 'columns'} along "
                f"dimension {dim}, not divisible into {what}{self.comm.size} ranks (the TP size)"
            )
        spec = ShardSpec(dim, parts, tuple(full.shape))
        piece = nn.Parameter(cut(full.detach(), spec, self.comm.rank, self.comm.size), full.requires_grad)
        setattr(module, attr, piece)
        self._done[id(full)] = piece
        self._names[id(full)] = f"{where}.{attr}"
        self.specs[id(piece)] = spec

    def pieces(self) -> list[nn.Parameter]:
        """Every shard made, once each."""
        return list(self._done.values())

    def split_originals(self) -> dict[int, str]:
        """id(full parameter) -> its name, for every parameter replaced by a shard."""
        return dict(self._names)


def _dense(module: Any, x: torch.Tensor, bias: bool) -> torch.Tensor:
    """The module's product with its (local) weight, with or without its bias."""
    b = module.bias if bias else None
    if _is_conv1d(module):
        return F.linear(x, module.weight.t(), b)
    return F.linear(x, module.weight, b)


def _check_type(module: nn.Module, where: str) -> None:
    if isinstance(module, nn.Linear) or _is_conv1d(module) or isinstance(module, nn.Embedding):
        return
    raise ValueError(
        f"tensor_parallel: plan entry {where!r} is a {type(module).__name__}; colwise/rowwise split an "
        "nn.Linear or transformers' Conv1D, vocab an nn.Embedding or nn.Linear (LM head)"
    )


def _set_forward(module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Patch the instance's forward (not the class, no wrapper module: names stay the same)."""
    object.__setattr__(module, "forward", forward)


def parallelize(module: Any, kind: str, where: str, sharder: Sharder) -> None:
    """Split `module` (named `where`) as `kind` and patch its instance forward."""
    comm = sharder.comm
    _check_type(module, where)
    if kind not in KINDS:
        raise ValueError(
            f"tensor_parallel: plan entry {where!r}: unknown kind {kind!r}, expected one of {KINDS}"
        )
    forward: Callable[[torch.Tensor], torch.Tensor]
    if isinstance(module, nn.Embedding):
        if kind != "vocab":
            raise ValueError(
                f"tensor_parallel: {where!r} is an nn.Embedding: its plan entry must be 'vocab', not {kind!r}"
            )
        if module.max_norm is not None:
            raise ValueError(f"tensor_parallel: {where!r}: an nn.Embedding with max_norm is not supported")
        sharder.shard(module, "weight", 0, 1, where)
        lo, hi = vocab_range(module.num_embeddings, comm.rank, comm.size)
        pad = module.padding_idx

        def forward(ids: torch.Tensor) -> torch.Tensor:
            outside = (ids < lo) | (ids >= hi)
            local = torch.where(outside, torch.zeros_like(ids), ids - lo)
            out = F.embedding(local, module.weight, None if pad is None or not lo <= pad < hi else pad - lo)
            return reduce_from_tp(out * ~outside.unsqueeze(-1), comm)

        _set_forward(module, forward)
        return
    out_dim = 1 if _is_conv1d(module) else 0  # Conv1D's weight is (in, out)
    if kind in ("colwise", "colwise_qkv", "vocab"):
        parts = 3 if kind == "colwise_qkv" else 1
        sharder.shard(module, "weight", out_dim, parts, where)
        sharder.shard(module, "bias", 0, parts, where)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return _dense(module, copy_to_tp(x, comm), bias=True)

    else:  # rowwise
        sharder.shard(module, "weight", 1 - out_dim, 1, where)

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = reduce_from_tp(_dense(module, x, bias=False), comm)
            return out if module.bias is None else out + module.bias

    _set_forward(module, forward)


def gather_full(local: torch.Tensor, spec: ShardSpec, comm: Comm) -> torch.Tensor:
    """Every rank's shard of one parameter joined into the full tensor (collective over comm)."""
    flat = torch.empty(comm.size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(flat, local.detach().contiguous().reshape(-1))
    pieces = list(flat.view(comm.size, *local.shape).unbind(0))
    return join(pieces, spec)
