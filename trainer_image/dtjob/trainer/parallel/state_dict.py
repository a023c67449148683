"""`full_state_dict(wrapped)`: the unsharded weights of a wrapped model, as the plain model's
`state_dict()` would give them (same keys, tied weights under each of their names, persistent
buffers), as CPU tensors on rank 0, so `torch.save` or a Hugging Face `save_pretrained` writes a
plain model. Every rank of the wrapper's group must call it (it gathers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtjob.trainer.parallel import common
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.ddp import DataParallel
from dtjob.trainer.parallel.fsdp import FullyShardedModule
from dtjob.trainer.parallel.tp.module import TPState, gather_split, tp_full_state_dict, tp_state


def _keys_to_tensors(module: nn.Module) -> list[tuple[str, int]]:
    """(state-dict key, id of the tensor behind it) in the plain model's state_dict() order."""
    keys: list[tuple[str, int]] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in sub._parameters.items():
            if p is not None:
                keys.append((pre + name, id(p)))
        for name, b in sub._buffers.items():
            if b is not None and name not in sub._non_persistent_buffers_set:
                keys.append((pre + name, id(b)))
    return keys


def _rank0_buffers(module: nn.Module, comm: Comm) -> dict[int, torch.Tensor]:
    """id(buffer) -> rank 0's value of it, on the CPU (collective over `comm`): each rank's forward
    updates its own buffers (BatchNorm's statistics), and every rank must return the same dict."""
    buffers = [b for b in module.buffers() if b is not None]
    copies = [b.detach().clone() for b in buffers]
    common.broadcast_from_rank0(copies, comm)
    return {id(b): c.cpu() for b, c in zip(buffers, copies, strict=True)}


def _sharded(wrapped: FullyShardedModule, rank0_only: bool) -> dict[str, torch.Tensor]:
    full_of: dict[int, torch.Tensor] = {}  # id(full parameter) -> its gathered value on the CPU
    buffers = {} if rank0_only else _rank0_buffers(wrapped.module, wrapped.comm)
    wrapped._sync_params()
    for unit in wrapped.units:
        if wrapped.stage == 3:
            gathered = torch.empty(unit.padded, dtype=unit.dtype, device=unit.device)
            wrapped.comm.all_gather(gathered, unit.send_shard())
            flat = torch.empty(unit.numel, dtype=unit.dtype, device=unit.device)
            unit.copy_out(gathered, flat)
        else:
            flat = unit.full
        if rank0_only and wrapped.comm.rank != 0:
            continue
        host = flat.detach().cpu()
        for s in unit.slots:
            full_of[id(s.param)] = host[s.offset : s.offset + s.numel].view(s.shape).clone()
    if rank0_only and wrapped.comm.rank != 0:
        return {}
    with wrapped._shards_registered():
        # Registered shards stand for their full parameters; map back through the registrations.
        back = {id(piece): full for _sub, _attr, full, piece in wrapped._registrations}
        out: dict[str, torch.Tensor] = {}
        tensors = {id(t): t for t in [*wrapped.module.parameters(), *wrapped.module.buffers()]}
        for key, tid in _keys_to_tensors(wrapped.module):
            full = back.get(tid)
            if full is not None:
                out[key] = full_of[id(full)]
            elif tid in buffers:
                out[key] = buffers[tid]
            else:  # frozen parameters and buffers: replicated, whole on every rank
                out[key] = tensors[tid].detach().cpu().clone()
    return out


def _of_tp(
    tp: TPState | None, gathered: dict[str, torch.Tensor], rank0_only: bool
) -> dict[str, torch.Tensor]:
    """A wrapper's state dict over a tensor_parallel model holds this TP rank's shards: join them.
    With rank0_only, the wrapper's rank 0 of each TP coordinate holds it (global ranks 0..T-1 of
    a mesh: one TP group, which gathers); the result stays on global rank 0."""
    if tp is None:
        return gathered
    if rank0_only and not gathered:
        return {}
    out = gather_split(gathered, tp)
    return {} if rank0_only and torch.distributed.get_rank() != 0 else out


def full_state_dict(wrapped: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The plain model's state dict on rank 0 (every rank with rank0_only=False); {} elsewhere."""
    tp = tp_state(getattr(wrapped, "module", wrapped))
    if isinstance(wrapped, FullyShardedModule):
        return _of_tp(tp, _sharded(wrapped, rank0_only), rank0_only)
    pipeline_state = getattr(wrapped, "full_state_dict", None)
    if callable(pipeline_state):  # a Pipeline gathers its stages itself
        result: dict[str, torch.Tensor] = pipeline_state(rank0_only=rank0_only)
        return _of_tp(tp, result, rank0_only)
    module: Any = wrapped.module if isinstance(wrapped, DataParallel) else wrapped
    state = tp_state(module)
    if state is not None:  # tensor_parallel (under data_parallel or not): gather the splits
        return tp_full_state_dict(module, state, rank0_only)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank0_only and rank != 0:
        return {}
    out = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    if isinstance(wrapped, DataParallel) and not rank0_only:
        buffers = _rank0_buffers(module, wrapped.comm)
        for key, tid in _keys_to_tensors(module):
            if tid in buffers:
                out[key] = buffers[tid]
    return out
