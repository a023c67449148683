"""Everything a checkpoint holds besides the data position: the model, its optimizer, a learning-rate
scheduler and the user's own extras, translated to and from global flat shards (parallel/shards.py).

Keys: "model.<name>" for parameters and persistent buffers, "optim.<name>.<state>" for every
optimizer state shaped like its parameter (Adam's exp_avg, exp_avg_sq, ...), named as in the
unwrapped model, so a checkpoint written with one wrapper at one world size loads into another at
another. The optimizer's other state (step counts) and its parameter groups' settings travel as
JSON in the manifest (`extra_state`); the scheduler's state_dict and the extras are saved by rank 0
(`global_state`, torch.save'd: plain Python values and tensors only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtjob.trainer.parallel.shards import FetchRange, FlatShard, LocalShard, local_tensor
from dtjob.trainer.parallel.tp.module import check_checkpoint_tp_size, tp_size_of


def local_shards_of(model: nn.Module) -> tuple[list[LocalShard], list[LocalShard]]:
    """(parameters, buffers) as local shards: a dtjob wrapper says where its pieces sit; a plain
    module is replicated on every rank of the world (rank 0 writes the buffers, which ranks may
    hold differently: BatchNorm's statistics)."""
    shards = getattr(model, "local_shards", None)
    if callable(shards):
        return shards(), model.local_buffers()  # type: ignore[operator]
    rank = dist.get_rank() if dist.is_initialized() else 0
    size = dist.get_world_size() if dist.is_initialized() else 1
    from dtjob.trainer.parallel.common import persistent_buffers

    params = [LocalShard.replicated(n, p, rank, size) for n, p in model.named_parameters()]
    buffers = [LocalShard.from_replica0(n, b, rank) for n, b in persistent_buffers(model).items()]
    return params, buffers


def _flat(shard: LocalShard, tensor: torch.Tensor) -> FlatShard:
    """The part of `tensor` (shaped like the shard's local tensor) this rank writes."""
    lo, hi = shard.write
    local = local_tensor(tensor).detach().reshape(-1)[lo:hi]
    return FlatShard(shard.global_shape, tensor.dtype, shard.offset + lo, local)


def _is_tensor_state(value: Any, param: torch.Tensor) -> bool:
    """An optimizer state shaped like its parameter (Adam's exp_avg), saved as a global tensor; a
    0-dim one only for a DTensor parameter (fully_shard's replicated 0-dim piece), since a plain
    0-dim tensor is also what step counts are."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return False
    return value.dim() > 0 or isinstance(value, DTensor)


def _json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return list(value)
    return value


def _from_json(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]), device=device)
    return value


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's part of an optimizer state) as the parameter holds it: a DTensor of the
    same placement for a DTensor parameter (what the optimizer created at its first step)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
    )


class TrainState:
    """The objects one checkpoint saves and restores together."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.extras: dict[str, Any] = dict(extras or {})
        params, _ = local_shards_of(model)
        by_id = {id(s.tensor): s for s in params}
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in by_id:
                        raise ValueError(
                            "checkpoint: the optimizer holds a tensor that is not a parameter of the tracked "
                            "model; build it over the wrapped model's parameters() (for ZeRO: its shards)"
                        )

    # -- writing ---------------------------------------------------------------------------------
    def state_shards(self) -> dict[str, FlatShard]:
        params, buffers = local_shards_of(self.model)
        out: dict[str, FlatShard] = {}
        state = self.optimizer.state if self.optimizer is not None else {}
        for s in params:
            out[f"model.{s.name}"] = _flat(s, s.tensor)
            for key, value in state.get(s.tensor, {}).items():
                if _is_tensor_state(value, s.tensor):
                    out[f"optim.{s.name}.{key}"] = _flat(s, value)
        for s in buffers:
            out[f"model.{s.name}"] = _flat(s, s.tensor)
        return out

    def extra_state(self) -> dict[str, Any]:
        """JSON: per parameter its optimizer's non-tensor state, the tensor states' names, and the
        parameter groups' settings (identical on every rank for the same script)."""
        if self.optimizer is None:
            return {"tensor_parallel": tp_size_of(self.model)}
        params, _ = local_shards_of(self.model)
        scalars: dict[str, dict[str, Any]] = {}
        tensor_states: set[str] = set()
        for s in params:
            for key, value in self.optimizer.state.get(s.tensor, {}).items():
                if _is_tensor_state(value, s.tensor):
                    tensor_states.add(key)
                else:
                    scalars.setdefault(s.name, {})[key] = _json(value)
        distinct = {repr(sorted(v.items())) for v in scalars.values()}
        common = next(iter(scalars.values())) if len(distinct) == 1 and len(scalars) == len(params) else None
        groups = [
            {
                k: _json(v)
                for k, v in g.items()
                if k != "params" and isinstance(v, (int, float, str, bool, tuple))
            }
            for g in self.optimizer.param_groups
        ]
        return {
            # Split parameters are stored per TP rank: another size cannot load them (load()).
            "tensor_parallel": tp_size_of(self.model),
            "tensor_states": sorted(tensor_states),
            # One copy when every parameter has the same (Adam's step count): identical on every
            # rank whichever parameters it holds, with no communication.
            "common": common,
            "scalars": {} if common is not None else scalars,
            "param_groups": groups,
            # Parameters the optimizer has not stepped yet (no rank got a gradient for them, so
            # .grad stayed None): they load without state, as they were saved.
            "stateless": sorted(s.name for s in params if not self.optimizer.state.get(s.tensor)),
        }

    def global_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"extras": self.extras}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    # -- reading ---------------------------------------------------------------------------------
    def load(self, fetch: FetchRange, extra: Mapping[str, Any], global_state: Mapping[str, Any]) -> None:
        if "tensor_parallel" in extra:  # absent from checkpoints written before it was recorded
            check_checkpoint_tp_size(int(extra["tensor_parallel"]), self.model)
        params, buffers = local_shards_of(self.model)
        optim = extra if self.optimizer is not None else {}
        tensor_states = optim.get("tensor_states", [])
        with torch.no_grad():
            for s in [*params, *buffers]:
                local = local_tensor(s.tensor)
                local.copy_(fetch(f"model.{s.name}", s.offset, local.numel()).view(local.shape))
            if self.optimizer is not None:
                stateless = set(optim.get("stateless", []))
                for s in params:
                    p, local = s.tensor, local_tensor(s.tensor)
                    if s.name in stateless:
                        self.optimizer.state.pop(p, None)
                        continue
                    scalars = optim.get("common") or optim.get("scalars", {}).get(s.name, {})
                    # As torch's load_state_dict: "step" stays on the CPU unless the optimizer
                    # keeps it on the device (capturable or fused).
                    group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
                    on_device = bool(group.get("capturable") or group.get("fused"))
                    state: dict[str, Any] = {
                        k: _from_json(v, p.device if on_device or k != "step" else torch.device("cpu"))
                        for k, v in scalars.items()
                    }
                    for key in tensor_states:
                        value = fetch(f"optim.{s.name}.{key}", s.offset, local.numel())
                        value = value.to(device=local.device, dtype=local.dtype).view(local.shape).clone()
                        state[key] = _like(p, value)
                    if state:
                        self.optimizer.state[p] = state
                    else:
                        self.optimizer.state.pop(p, None)
                saved_groups = optim.get("param_groups") or []
                if len(saved_groups) == len(self.optimizer.param_groups):
                    for group, saved in zip(self.optimizer.param_groups, saved_groups, strict=True):
                        for k, v in saved.items():
                            if k in group:
                                group[k] = tuple(v) if isinstance(group[k], tuple) else v
        after_load = getattr(self.model, "after_load", None)
        if callable(after_load):
            after_load()
        if self.scheduler is not None and "scheduler" in global_state:
            self.scheduler.load_state_dict(global_state["scheduler"])
        self.extras.update(global_state.get("extras", {}))
