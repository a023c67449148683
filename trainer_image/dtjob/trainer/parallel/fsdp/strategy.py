"""FSDP with ZeRO stages, on flat units (one per block of the model, see flat.py).

stage 1: every rank keeps all parameters and all (averaged) gradients; the optimizer only updates
    this rank's shard (so optimizer state is 1/N), then the shards are all-gathered.
stage 2: as 1, but each unit's gradients are reduce-scattered the moment they are complete and the
    full gradients dropped: a rank keeps only its gradient shard.
stage 3: as 2, and the parameters too live only as shards. A block's parameters are all-gathered
    just before its forward (the next block's gather is started early: prefetch) and freed after;
    gathered again just before its backward (hook on the block's outputs) and freed once all its
    gradients have arrived.

The optimizer is built over one flat shard parameter per unit, so any elementwise torch.optim
optimizer works and its state is sharded for free. Reductions run in fp32 and in a fixed order
(units in reverse, launched only after every earlier one), so every rank issues the same
collective sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dtjob.trainer.parallel import common
from dtjob.trainer.parallel.comm import Comm, Handle
from dtjob.trainer.parallel.config import ParallelConfig
from dtjob.trainer.parallel.fsdp.flat import FlatUnit
from dtjob.trainer.parallel.state import FetchRange, FlatShard


class _Reduction:
    """A unit's gradients on their way: flat fp32 input and, for stages 2/3, the shard output."""

    def __init__(self, flat: torch.Tensor | None, out: torch.Tensor | None) -> None:
        self.flat = flat
        self.out = out
        self.handle: Handle | None = None


class FSDPStrategy(common.DataParallel):
    def __init__(
        self,
        model: nn.Module,
        config: ParallelConfig,
        optimizer_factory: common.OptimizerFactory,
        loss_fn: common.LossFn,
        comm: Comm,
    ) -> None:
        super().__init__(model, config, loss_fn, comm)
        self.stage = config.zero_stage

        try:
            blocks = common.blocks_in_order(model)
        except TypeError:
            blocks = [model]  # one unit: ZeRO-3 then gathers the whole model at once
        shared = common.parameter_shared_across(model, [[b] for b in blocks]) if self.stage == 3 else None
        if shared is not None:
            name, first, second = shared
            raise ValueError(
                f"ParallelConfig(strategy='fsdp', zero_stage=3): parameter {name!r} is used by blocks "
                f"{first} and {second} of blocks_in_order(), but ZeRO-3 gathers and frees each block's "
                "parameters on their own; untie it (give each block its own copy), or use zero_stage=1 "
                "or 2, or strategy='ddp'"
            )
        if config.activation_checkpointing:
            common.apply_activation_checkpointing(blocks)
        self.units, self.block_units, self.root_unit = self._make_units(model, blocks)
        # Reduction order: the order backward completes units (last block first), root last.
        self._reduce_order = [*reversed(self.block_units), *([self.root_unit] if self.root_unit else [])]

        self.shards: list[nn.Parameter] = []
        self.grad_full: dict[int, torch.Tensor] = {}  # stage 1: unit index -> full flat gradients
        for unit in self.units:
            if self.stage == 3:
                shard = nn.Parameter(unit.local_view().clone())
                unit.free_full()
            else:
                shard = nn.Parameter(unit.local_view())  # shares storage with the full buffer
            if self.stage == 1:
                grad_full = torch.zeros(unit.padded, dtype=torch.float32)
                self.grad_full[unit.index] = grad_full
                for s in unit.slots:
                    s.param.grad = grad_full[s.offset : s.offset + s.numel].view(s.shape)
                lo, hi = unit.shard_range
                shard.grad = grad_full[lo:hi]
            else:
                shard.grad = torch.zeros(unit.shard_len, dtype=torch.float32)
            self.shards.append(shard)
            for s in unit.slots:
                s.param.register_post_accumulate_grad_hook(lambda p, u=unit: self._on_grad_ready(u, p))
        self._hooks: list[RemovableHandle] = []
        if self.stage == 3:
            self._register_zero3_hooks()
        self._sync = True
        self._in_backward = False
        self._pending_gather: dict[int, Handle] = {}
        self._reductions: dict[int, _Reduction] = {}
        self._ready: set[int] = set()
        self._next_reduce = 0
        self._prebackward_done: set[int] = set()
        # ZeRO-3: the most units whose full parameters were held at once during the last step.
        self.peak_gathered_units = 0
        self.optimizer = optimizer_factory(self.shards)

    def _make_units(
        self, model: nn.Module, blocks: list[nn.Module]
    ) -> tuple[list[FlatUnit], list[FlatUnit], FlatUnit | None]:
        names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        taken: set[int] = set()
        groups: list[list[tuple[str, nn.Parameter]]] = []
        for block in blocks:
            group = []
            for p in block.parameters():
                if id(p) in names and id(p) not in taken:
                    taken.add(id(p))
                    group.append((names[id(p)], p))
            groups.append(group)
        rest = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in taken]
        units: list[FlatUnit] = []
        block_units: list[FlatUnit] = []
        self._unit_of_block: dict[int, FlatUnit] = {}
        for block, group in zip(blocks, groups, strict=True):
            if group:
                unit = FlatUnit(len(units), group, self.comm.rank, self.comm.size)
                units.append(unit)
                block_units.append(unit)
                self._unit_of_block[id(block)] = unit
        root = None
        if rest:
            root = FlatUnit(len(units), rest, self.comm.rank, self.comm.size)
            units.append(root)
        self._blocks_with_units = [b for b in blocks if id(b) in self._unit_of_block]
        return units, block_units, root

    # -- TrainStrategy (data_parallel_rank/size and set_lr: common.DataParallel) ----------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1: accumulate full gradients locally. Stages 2/3 reduce-scatter every backward
        anyway (there are no full gradients to accumulate into), so this changes nothing there."""
        previous, self._sync = self._sync, self.stage != 1
        try:
            yield
        finally:
            self._sync = previous

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        micro = common.split_batch(inputs, targets, self.config.grad_accum, "grad_accum")
        self.peak_gathered_units = 0
        for shard in self.shards:
            assert shard.grad is not None
            shard.grad.zero_()
        for grad_full in self.grad_full.values():
            grad_full.zero_()
        if self.named_buffers:
            common.broadcast_from_rank0(list(self.named_buffers.values()), self.comm)
        if self.root_unit is not None and self.stage == 3:
            self._gather(self.root_unit)
        local_loss = 0.0
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                self._start_backward_bookkeeping()
                with common.precision_context(self.config.precision):
                    loss = self.loss_fn(self.model(x), y) / len(micro)
                self._in_backward = True
                try:
                    loss.backward()
                finally:
                    self._in_backward = False
                local_loss += float(loss.detach())
                self._finish_reductions()
        if self.config.grad_clip is not None:
            self._clip(self.config.grad_clip)
        self.optimizer.step()
        if self.stage == 3:
            for unit in self.units:
                if unit.gathered:
                    unit.free_full()
        else:
            self._all_gather_params()
        return self.comm.all_reduce_mean_scalar(local_loss)

    # -- parameter gathering (ZeRO-3) ----------------------------------------------------------
    def _register_zero3_hooks(self) -> None:
        for pos, block in enumerate(self._blocks_with_units):
            self._hooks.append(block.register_forward_pre_hook(lambda m, a, pos=pos: self._pre_forward(pos)))
            self._hooks.append(
                block.register_forward_hook(lambda m, a, out, pos=pos: self._post_forward(pos, out))
            )

    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.gathered or unit.index in self._pending_gather:
            return
        unit.regrow_full()
        held = sum(1 for u in self.units if u.full.untyped_storage().nbytes() > 0)
        self.peak_gathered_units = max(self.peak_gathered_units, held)
        shard = self.shards[unit.index].detach()
        self._pending_gather[unit.index] = self.comm.all_gather(unit.full, shard, async_op=True)

    def _gather(self, unit: FlatUnit) -> None:
        self._start_gather(unit)
        handle = self._pending_gather.pop(unit.index, None)
        if handle is not None:
            handle.wait()
        unit.gathered = True

    def _pre_forward(self, pos: int) -> None:
        self._gather(self.block_units[pos])
        if self.config.zero3_prefetch and pos + 1 < len(self.block_units):
            self._start_gather(self.block_units[pos + 1])

    def _post_forward(self, pos: int, output: Any) -> None:
        if not torch.is_grad_enabled() and not self._in_backward:
            if pos < len(self.block_units) - 1:
                self.block_units[pos].free_full()
            return
        for t in _tensors_in(output):
            if t.requires_grad:
                t.register_hook(lambda grad, pos=pos: self._pre_backward(pos))
        # The last block's backward comes first: keep it instead of gathering it straight back.
        if not self._in_backward and pos < len(self.block_units) - 1:
            self.block_units[pos].free_full()

    def _pre_backward(self, pos: int) -> None:
        if pos in self._prebackward_done:
            return
        self._prebackward_done.add(pos)
        self._gather(self.block_units[pos])
        if self.config.zero3_prefetch and pos > 0:
            self._start_gather(self.block_units[pos - 1])

    # -- gradient reduction --------------------------------------------------------------------
    def _start_backward_bookkeeping(self) -> None:
        for unit in self.units:
            unit.grads_pending = len(unit.slots)
        self._ready.clear()
        self._next_reduce = 0
        self._prebackward_done.clear()

    def _on_grad_ready(self, unit: FlatUnit, p: torch.Tensor) -> None:
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            self._unit_ready(unit)

    def _unit_ready(self, unit: FlatUnit) -> None:
        if self.stage == 1:
            grad_full = self.grad_full[unit.index]
            for s in unit.slots:  # autograd accumulates in place into the views; re-point if replaced
                view = grad_full[s.offset : s.offset + s.numel].view(s.shape)
                if s.param.grad is not None and s.param.grad.data_ptr() != view.data_ptr():
                    view.add_(s.param.grad)
                s.param.grad = view
            self._reductions[unit.index] = _Reduction(grad_full, None)
        else:
            flat = unit.flatten_grads()
            for s in unit.slots:
                s.param.grad = None
            self._reductions[unit.index] = _Reduction(flat, torch.empty(unit.shard_len, dtype=torch.float32))
            if self.stage == 3:
                unit.free_full()
        self._ready.add(unit.index)
        if self._sync:
            self._launch_ready()

    def _launch_ready(self) -> None:
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].index in self._ready:
            reduction = self._reductions[order[self._next_reduce].index]
            assert reduction.flat is not None
            if reduction.out is None:
                reduction.handle = self.comm.all_reduce_sum(reduction.flat, async_op=True)
            else:
                reduction.handle = self.comm.reduce_scatter_sum(reduction.out, reduction.flat, async_op=True)
            self._next_reduce += 1

    def _finish_reductions(self) -> None:
        if not self._sync:
            self._reductions.clear()
            return
        for unit in self._reduce_order:  # units that took no part in this backward
            if unit.index not in self._ready:
                self._unit_ready(unit)
        self._launch_ready()
        for unit in self._reduce_order:
            reduction = self._reductions.pop(unit.index)
            assert reduction.handle is not None
            reduction.handle.wait()
            if reduction.out is None:
                assert reduction.flat is not None
                reduction.flat.div_(self.comm.size)
            else:
                grad = self.shards[unit.index].grad
                assert grad is not None
                grad.add_(reduction.out, alpha=1.0 / self.comm.size)

    def _clip(self, max_norm: float) -> None:
        sq = torch.zeros(1, dtype=torch.float64)
        for shard in self.shards:
            assert shard.grad is not None
            sq += shard.grad.double().pow(2).sum()
        self.comm.all_reduce_sum(sq)
        coef = common.clip_coefficient(float(sq.sqrt()), max_norm)
        if coef < 1.0:
            for shard in self.shards:
                assert shard.grad is not None
                shard.grad.mul_(coef)

    def _all_gather_params(self) -> None:
        handles = []
        for unit, shard in zip(self.units, self.shards, strict=True):
            # The shard is a view of `full`; gather from a copy so input and output never alias.
            handles.append(self.comm.all_gather(unit.full, shard.detach().clone(), async_op=True))
        for handle in handles:
            handle.wait()

    # -- CheckpointableStrategy ----------------------------------------------------------------
    def state_shards(self) -> Mapping[str, FlatShard]:
        shards: dict[str, FlatShard] = {}
        for unit, shard in zip(self.units, self.shards, strict=True):
            state = self.optimizer.state.get(shard, {})
            tensor_states = {k: v for k, v in state.items() if _is_shard_state(v, shard)}
            pieces = {s.name: (s, 0, 0, 0) for s in unit.slots}  # empty shard unless overlapping
            for piece in unit.overlaps():
                pieces[piece[0].name] = piece
            for name, (slot, start, at, length) in pieces.items():
                shape = tuple(slot.shape)
                local = shard.detach()[at : at + length]
                shards[f"model.{name}"] = FlatShard(shape, slot.param.dtype, start, local)
                for state_name, value in tensor_states.items():
                    shards[f"optim.{name}.{state_name}"] = FlatShard(
                        shape, value.dtype, start, value[at : at + length]
                    )
        for name, b in self.named_buffers.items():
            lo, hi = common.split_range(b.numel(), self.comm.rank, self.comm.size)
            shards[f"model.{name}"] = FlatShard(tuple(b.shape), b.dtype, lo, b.reshape(-1)[lo:hi])
        return shards

    def extra_state(self) -> dict[str, Any]:
        state_of_unit = {}
        named: dict[str, torch.Tensor] = {}
        for unit, shard in zip(self.units, self.shards, strict=True):
            for s in unit.slots:
                state_of_unit[s.name] = self.optimizer.state.get(shard, {})
                named[s.name] = shard  # states shaped like the shard are the sharded ones
        return {"optim": common.optimizer_extra_state(named, lambda n: state_of_unit[n])}

    def load_state_shards(self, fetch: FetchRange, extra: dict[str, Any]) -> None:
        tensor_states = extra.get("optim", {}).get("tensor_states", [])
        with torch.no_grad():
            for unit, shard in zip(self.units, self.shards, strict=True):
                shard.zero_()
                state: dict[str, Any] = common.optimizer_scalars_from_extra(extra, unit.slots[0].name)
                for state_name in tensor_states:
                    state[state_name] = torch.zeros(unit.shard_len, dtype=shard.dtype)
                for slot, start, at, length in unit.overlaps():
                    shard[at : at + length] = fetch(f"model.{slot.name}", start, length)
                    for state_name in tensor_states:
                        state[state_name][at : at + length] = fetch(
                            f"optim.{slot.name}.{state_name}", start, length
                        )
                if state:
                    self.optimizer.state[shard] = state
                else:
                    self.optimizer.state.pop(shard, None)
            for name, b in self.named_buffers.items():
                b.copy_(fetch(f"model.{name}", 0, b.numel()).view(b.shape))
        if self.stage != 3:
            self._all_gather_params()

    # -- introspection for tests and benchmarks ------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds between steps."""
        params = sum(s.numel() * 4 for s in self.shards)
        if self.stage != 3:
            params = sum(u.full.untyped_storage().nbytes() for u in self.units)
        grads = sum(g.numel() * g.element_size() for g in self.grad_full.values())
        if self.stage != 1:
            grads = sum(s.grad.numel() * s.grad.element_size() for s in self.shards if s.grad is not None)
        optim = sum(
            v.numel() * v.element_size()
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        return {"params": params, "grads": grads, "optim": optim}


def _is_shard_state(value: Any, shard: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == shard.shape


def _tensors_in(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors_in(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors_in(item)]
    return []
