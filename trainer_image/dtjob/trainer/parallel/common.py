"""Pieces every strategy shares: loss, batch slicing, precision, activation checkpointing,
gradient clipping and the checkpoint format of replicated (not sharded) state."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.config import ParallelConfig
from dtjob.trainer.parallel.state import FetchRange, FlatShard

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (..., classes), integer targets (...)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def blocks_in_order(model: nn.Module) -> list[nn.Module]:
    """The model as a sequence of blocks whose composition is `model.forward`.

    `model.blocks_in_order()` if the model defines it (dtjob's GPT and MLP do), else the children
    of an `nn.Sequential`.
    """
    method = getattr(model, "blocks_in_order", None)
    if callable(method):
        blocks = list(method())
    elif isinstance(model, nn.Sequential):
        blocks = list(model)
    else:
        raise TypeError(
            f"{type(model).__name__} is not a sequence of blocks: give it a blocks_in_order() method "
            "returning the modules whose composition is forward(), or use nn.Sequential"
        )
    if not blocks:
        raise ValueError(f"{type(model).__name__}.blocks_in_order() returned no blocks")
    return blocks


def parameter_shared_across(
    model: nn.Module, groups: Sequence[Sequence[nn.Module]]
) -> tuple[str, int, int] | None:
    """A trainable parameter that modules of two different `groups` use: its name in `model` and
    the two group indices (first found), or None. (A frozen one is never sharded or updated.)

    ZeRO-3 (a group per block) and the pipeline (a group per stage) keep each parameter in one
    group. A weight tied across groups would be freed while the other group still needs it
    (ZeRO-3), or silently train as one copy per stage (the pipeline).
    """
    names = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, int] = {}
    for index, group in enumerate(groups):
        for module in group:
            for p in module.parameters():
                if not p.requires_grad:
                    continue
                first = owner.setdefault(id(p), index)
                if first != index:
                    return names.get(id(p), "?"), first, index
    return None


def split_batch(
    inputs: torch.Tensor, targets: torch.Tensor, parts: int, what: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a batch into `parts` equal micro-batches along dim 0 (equal, so means of means are means)."""
    n = inputs.shape[0]
    if targets.shape[0] != n:
        raise ValueError(f"inputs have {n} samples but targets have {targets.shape[0]}")
    if parts < 1 or n % parts:
        raise ValueError(f"this rank's batch of {n} samples does not split into {what}={parts} equal parts")
    return list(zip(inputs.chunk(parts), targets.chunk(parts), strict=True))


def precision_context(precision: str) -> contextlib.AbstractContextManager[Any]:
    """bf16: compute in bfloat16 under autocast while weights, gradients and reductions stay fp32."""
    if precision == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    Patches the instance's forward (not the class, and without a wrapper module) so parameter
    names, and therefore checkpoints, do not change. Module hooks still run around the call.
    """
    for block in blocks:
        original = block.forward

        def checkpointed(*args: Any, _forward: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ scales gradients by (never above 1)."""
    if not math.isfinite(total_norm):
        raise FloatingPointError(f"gradient norm is {total_norm}; refusing to step on it")
    return min(1.0, max_norm / (total_norm + 1e-6))


def split_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """The flat range [lo, hi) of a replicated tensor that replica `rank` of `size` writes."""
    chunk = -(-numel // size)
    lo = min(numel, rank * chunk)
    return lo, min(numel, lo + chunk)


def _is_sharded_state(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def scalar_to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    return value


def _scalar_from_json(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
    return value


def replicated_state_shards(
    named_params: Mapping[str, nn.Parameter],
    named_buffers: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    rank: int,
    size: int,
) -> dict[str, FlatShard]:
    """Shards of state every replica holds in full: replica `rank` reports its `split_range`."""
    shards: dict[str, FlatShard] = {}

    def add(key: str, tensor: torch.Tensor) -> None:
        lo, hi = split_range(tensor.numel(), rank, size)
        local = tensor.detach().reshape(-1)[lo:hi]
        shards[key] = FlatShard(tuple(tensor.shape), tensor.dtype, lo, local)

    for name, p in named_params.items():
        add(f"model.{name}", p)
        for state_name, value in optimizer.state.get(p, {}).items():
            if _is_sharded_state(value, p):
                add(f"optim.{name}.{state_name}", value)
    for name, b in named_buffers.items():
        add(f"model.{name}", b)
    return shards


def optimizer_extra_state(
    named_params: Mapping[str, torch.Tensor], state_of: Callable[[str], Mapping[str, Any]]
) -> dict[str, Any]:
    """Which tensor states exist, and the non-tensor (or scalar) states, as JSON.

    When every parameter has the same scalar state (the usual case: Adam's step count) it is
    stored once under "common", which keeps this identical on every rank even when ranks hold
    different parameters (pipeline stages) without any communication.
    """
    tensor_states: set[str] = set()
    scalars: dict[str, dict[str, Any]] = {}
    for name, p in named_params.items():
        for state_name, value in state_of(name).items():
            if _is_sharded_state(value, p):
                tensor_states.add(state_name)
            else:
                scalars.setdefault(name, {})[state_name] = scalar_to_json(value)
    distinct = {repr(sorted(v.items())) for v in scalars.values()}
    if len(distinct) == 1 and len(scalars) == len(named_params):
        return {"tensor_states": sorted(tensor_states), "common": next(iter(scalars.values())), "scalars": {}}
    return {"tensor_states": sorted(tensor_states), "scalars": scalars}


def optimizer_scalars_from_extra(extra: Mapping[str, Any], name: str) -> dict[str, Any]:
    optim = extra.get("optim", {})
    scalars = optim.get("scalars", {}).get(name, optim.get("common", {}))
    return {k: _scalar_from_json(v) for k, v in scalars.items()}


def load_replicated_state(
    named_params: Mapping[str, nn.Parameter],
    named_buffers: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    fetch: FetchRange,
    extra: Mapping[str, Any],
) -> None:
    """Every replica reads the whole of each tensor it holds."""
    tensor_states = extra.get("optim", {}).get("tensor_states", [])
    with torch.no_grad():
        for name, p in named_params.items():
            p.copy_(fetch(f"model.{name}", 0, p.numel()).view(p.shape))
            state: dict[str, Any] = optimizer_scalars_from_extra(extra, name)
            if not state and not tensor_states:
                optimizer.state.pop(p, None)
                continue
            for state_name in tensor_states:
                value = fetch(f"optim.{name}.{state_name}", 0, p.numel())
                state[state_name] = value.to(p.dtype).view(p.shape).clone()
            optimizer.state[p] = state
        for name, b in named_buffers.items():
            b.copy_(fetch(f"model.{name}", 0, b.numel()).view(b.shape))


def broadcast_from_rank0(tensors: list[torch.Tensor], comm: Comm) -> None:
    """Make every rank's tensors equal rank 0's: one broadcast per dtype, through a flat buffer."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, 0)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    if not lr >= 0:
        raise ValueError(f"learning rate must be >= 0, got {lr}")
    for group in optimizer.param_groups:
        group["lr"] = lr


class DataParallel:
    """What DDP and FSDP share: every rank of `comm` is one replica reading its own slice of the
    global batch, and one optimizer holds what the rank steps."""

    optimizer: torch.optim.Optimizer

    def __init__(self, model: nn.Module, config: ParallelConfig, loss_fn: LossFn, comm: Comm) -> None:
        """Keep what every replica needs, and start it from rank 0's parameters and buffers."""
        self.model = model
        self.config = config
        self.loss_fn = loss_fn
        self.comm = comm
        self.named_buffers = dict(model.named_buffers())
        broadcast_from_rank0([*model.parameters(), *self.named_buffers.values()], comm)

    @property
    def data_parallel_rank(self) -> int:
        return self.comm.rank

    @property
    def data_parallel_size(self) -> int:
        return self.comm.size

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)


def iter_unique(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Tensors with distinct storages (shared parameters counted once)."""
    seen: set[int] = set()
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            yield t
