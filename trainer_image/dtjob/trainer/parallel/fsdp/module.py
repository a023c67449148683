"""`fully_shard(model)`: ZeRO stages 1, 2 and 3, parameters sharded by rows (flat.py), in the user's loop.

    model = fully_shard(model, zero_stage=3)           # after init_process_group(), on its device
    optimizer = torch.optim.AdamW(model.parameters())  # this rank's shards; any parameter groups
    loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()

stage 1: every rank keeps all parameters and all gradients; the optimizer updates only this rank's
    shard (optimizer state is 1/N); after backward the gradients are reduce-scattered, and the
    updated shards are all-gathered before the next forward.
stage 2: as 1, but each unit's gradients are reduce-scattered the moment they are complete and the
    full gradients dropped: a rank keeps only its gradient shard. The flat copy a reduce-scatter
    reads is freed when the next unit's backward is done, so one is in flight at a time (as FSDP2).
    Gradient shards are new tensors each step: zero_grad() (set_to_none) frees them.
stage 3: as 2, and the parameters too live only as shards. A unit's parameters are all-gathered
    just before its forward (the next unit's gather starts early: prefetch) and freed after; gathered
    again just before its backward (a hook on the unit's outputs) and freed once its gradients are
    reduced. Parameters in no unit form the root unit, gathered from the start of the forward to
    the end of the backward.

Units: each `blocks_in_order()` block, else each repeated block (Hugging Face `_no_split_modules`,
or the longest ModuleList of one class), else the whole model; or `units=` (modules or names). A
parameter used by two units (a tied embedding and head) belongs to the root, as with FSDP2.

`model.parameters()` / `named_parameters()` are the original names and shapes, as FSDP2's: each is
a DTensor (placement Shard(0)) whose local tensor is the rows of the parameter this rank owns
(flat.py; possibly none), so code choosing parameter groups by name or `p.dim()` trains as in one
process. Between steps the wrapped module holds those shards too,
so `state_dict()` is those DTensors (load_state_dict takes them back, or full tensors, of which
each rank keeps its rows); `full_state_dict(model)` gathers the real weights. Reductions
average in the gradients' dtype and run in a fixed order (units in reverse, the root last), so
every rank issues the same sequence of collectives. Gradient norms: `model.clip_grad_norm_()` or
torch.nn.utils.clip_grad_norm_ (dtjob.trainer makes torch's count every rank's shard, see clip.py).

No gradient stays no gradient (fsdp/grad_flags.py): a parameter that got no gradient on any rank
in this backward (nor in an earlier no_sync micro-step since zero_grad) keeps `.grad = None` on
every rank's shard, so a torch optimizer skips it as in one process (AdamW neither decays it nor
moves its moments); one used on some ranks only is averaged over all ranks (zeros from the rest)
as DDP does. Like torch DDP's find_unused_parameters=True but automatic, and cheaper: one
all-reduce of a float32 flag per parameter per backward (4 bytes each), launched after the last
unit's reduce-scatter and waited for with it; the flags are read on the host only where this rank
has a piece that was None and whose parameter it got no gradient for. Under ZeRO-3 every rank
must run the same units' forwards (each gathers its unit: a collective), so skip an expert inside
a unit, not a whole unit on some ranks.

The model's own methods reached through the wrapper (`model.generate()`, `model.get_encoder()`)
and FSDP2's unshard() / reshard() run on the full parameters: see unshard.py.

ZeRO-Offload (`offload="optimizer"`, any stage): the parameters the user's optimizer is built over
are this rank's shards in host memory (DTensors whose local tensors are on the CPU, pinned when
the model is on CUDA), as FSDP2's CPUOffloadPolicy gives them; so the optimizer's state (AdamW's
moments: 8 bytes per parameter) is created on the host and its step runs there, and the loop is
unchanged. Each unit's reduced gradient shard is copied to the host as its reduce-scatter
finishes (backward returns once those copies landed); the updated shards are copied back to the
device just before each unit's next all-gather (flat.py). The device keeps the parameters (the
ZeRO-3 shard and the gathered unit, or ZeRO-1/2's full parameters) and gradients in flight, the
host 4 bytes of master weights, 4 of gradient and the optimizer's state per parameter it owns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dtjob.trainer.device import wait_for_copies
from dtjob.trainer.parallel import clip, common, guard, syncbn
from dtjob.trainer.parallel.comm import Comm, Handle
from dtjob.trainer.parallel.fsdp.flat import FlatUnit
from dtjob.trainer.parallel.fsdp.grad_flags import GradFlags
from dtjob.trainer.parallel.fsdp.unshard import Unsharding
from dtjob.trainer.parallel.shards import LocalShard, local_tensor
from dtjob.trainer.parallel.tp.module import check_wrappable, checkpoint_shards

log = logging.getLogger("dtjob.trainer.parallel")


class FullyShardedModule(Unsharding, common.GradientSync, common.Wrapper):
    """The module `fully_shard` returns; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        *,
        zero_stage: int,
        units: list[nn.Module],
        prefetch: bool,
        mixed_precision: str | None,
        broadcast_buffers: bool = True,
        offload: str | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.comm = comm
        self.stage = zero_stage
        self.offload = offload
        self.prefetch = prefetch
        self.mixed_precision = mixed_precision
        common.broadcast_from_rank0([*module.parameters(), *module.buffers()], comm)
        self._buffer_broadcast = common.BufferBroadcast(module, comm, broadcast_buffers)
        syncbn.bind_sync_batchnorms(module, comm, "fully_shard")
        device = next(p.device for p in module.parameters() if p.requires_grad)
        group = (
            comm.group if comm.group is not None else torch.distributed.distributed_c10d._get_default_group()
        )
        self.mesh = DeviceMesh.from_group(group, device.type)
        self.units, self.block_units, self.root_unit = self._make_units(module, units)
        self._position = {u.index: i for i, u in enumerate(self.block_units)}
        self._reduce_order = [*reversed(self.block_units), *([self.root_unit] if self.root_unit else [])]
        self._pieces = {p.slot.name: p for u in self.units for p in u.pieces}
        piece_of = {id(p.slot.param): p for p in self._pieces.values()}
        # Every state-dict name of a piece (a tied parameter has two).
        self._piece_by_key = {
            n: piece_of[id(p)]
            for n, p in module.named_parameters(remove_duplicate=False)
            if id(p) in piece_of
        }
        for piece in self._pieces.values():
            guard.mark(piece.param, "fully_shard")
        self._frozen = {n: p for n, p in module.named_parameters() if not p.requires_grad}
        # What named_parameters() gives: the original names and order, shards for trainable ones.
        self._visible = [
            (n, self._pieces[n].param if n in self._pieces else p) for n, p in module.named_parameters()
        ]
        # Where each trainable parameter is registered (a tied one twice): swapped between the
        # full parameters (during a step) and the shards (between steps).
        self._registrations: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        for sub in module.modules():
            for attr, p in list(sub._parameters.items()):
                if p is not None and id(p) in piece_of:
                    self._registrations.append((sub, attr, p, piece_of[id(p)].param))
        # Hooks reach this wrapper and its units weakly, by unit index (and a gradient hook by its
        # slot's position in the unit, for GradFlags; see common.weak_hook).
        for unit in self.units:
            for i, s in enumerate(unit.slots):
                s.param.register_post_accumulate_grad_hook(
                    common.weak_hook(self, "_grad_hook", unit.index, i)
                )
            if self.stage == 3:
                unit.free_full()
        self._grad_flags = GradFlags(self.units, comm)
        if self.stage == 1:
            self._grad_full = {u.index: torch.zeros_like(u.full) for u in self.units}
        for unit, sub in zip(self.block_units, self._unit_modules, strict=True):
            sub.register_forward_pre_hook(common.weak_hook(self, "_pre_forward_hook", unit.index))
            sub.register_forward_hook(common.weak_hook(self, "_post_forward_hook", unit.index))
        clip.install()
        self._sync = True
        self._step_open = False  # the full parameters are registered (a forward ran, backward pending)
        self._in_backward = False
        self._sync_this_backward = True
        self._pending_gather: dict[int, tuple[torch.Tensor, Handle]] = {}
        self._reductions: dict[int, tuple[torch.Tensor, torch.Tensor, Handle | None]] = {}
        self._ready: set[int] = set()
        self._next_reduce = 0  # _reduce_order[:_next_reduce] launched
        self._next_finish = 0  # _reduce_order[:_next_finish] waited for and added to the shards
        self._prebackward_done: set[int] = set()
        # ZeRO-3: the most units whose full parameters were held at once during the last step.
        self.peak_gathered_units = 0
        self._init_unsharding(list(zip(self.block_units, self._unit_modules, strict=True)))
        self._use_shards()

    def _make_units(
        self, model: nn.Module, units: list[nn.Module]
    ) -> tuple[list[FlatUnit], list[FlatUnit], FlatUnit | None]:
        names = common.module_names(model)
        param_names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        users: dict[int, set[int]] = {}
        for i, unit in enumerate(units):
            for p in unit.parameters():
                if id(p) in param_names:
                    users.setdefault(id(p), set()).add(i)
        groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in units]
        rest: list[tuple[str, nn.Parameter]] = []
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            owners = users.get(id(p), set())
            if len(owners) == 1:
                groups[next(iter(owners))].append((n, p))
            else:  # in no unit, or tied between units: the root, gathered for the whole step
                rest.append((n, p))
        flat: list[FlatUnit] = []
        self._unit_modules: list[nn.Module] = []
        for unit, group in zip(units, groups, strict=True):
            if group:  # a unit without trainable parameters of its own has nothing to shard
                label = names.get(id(unit), "?")
                flat.append(self._flat_unit(len(flat), label, group))
                self._unit_modules.append(unit)
        blocks = list(flat)
        root = None
        if rest:
            root = self._flat_unit(len(flat), "", rest)
            flat.append(root)
        return flat, blocks, root

    def _flat_unit(self, index: int, label: str, named: list[tuple[str, nn.Parameter]]) -> FlatUnit:
        rank, size, offload = self.comm.rank, self.comm.size, self.offload is not None
        return FlatUnit(index, label, named, self.mesh, rank, size, self.stage, offload)

    def host_tensors(self) -> list[torch.Tensor]:
        """offload="optimizer": what this wrapper keeps in host memory (each unit's shard of master
        weights and the gradients of its pieces); the optimizer's state is the optimizer's. [] else."""
        out: list[torch.Tensor] = []
        for unit in self.units:
            if unit.host is not None:
                out.append(unit.host)
                out += [local_tensor(p.param.grad) for p in unit.pieces if p.param.grad is not None]
        return out

    # -- the module interface -------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        # As torch's DDP broadcast_buffers=True: rank 0's buffers win (common.BufferBroadcast).
        self._buffer_broadcast.before_forward(grad and self._sync)
        self._open_step(grad)
        try:
            with common.autocast(self.mixed_precision, self.units[0].device):
                out = self.module(*args, **kwargs)
        except BaseException:
            self._close_step()
            raise
        if not grad:
            self._close_step()
        return out

    def _accumulates_locally(self) -> bool:
        """Stage 1 only: stages 2/3 hold no full gradients to accumulate into (common.GradientSync)."""
        return self.stage == 1

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        pre = prefix + "." if prefix else ""
        for name, p in self._visible:
            yield pre + name, p

    @contextlib.contextmanager
    def _shards_registered(self) -> Iterator[None]:
        """The shards registered in the wrapped module for a moment, also in the middle of a step."""
        if not self._step_open:
            yield
            return
        self._use_shards()
        try:
            yield
        finally:
            self._use_full()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The parameters as DTensors (this rank's rows) under the original names, and the buffers."""
        with self._shards_registered():
            return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """The DTensors state_dict() gives, or full tensors of the original shapes (each rank keeps
        its rows)."""
        local: dict[str, Any] = {}
        for key, value in state_dict.items():
            piece = self._piece_by_key.get(key)
            plain = isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
            if piece is not None and plain and value.shape == piece.slot.shape:
                rows = value.reshape(-1)[piece.start : piece.start + piece.length].view(piece.local.shape)
                value = piece.slot.as_dtensor(rows.to(piece.local.device), self.mesh)
            local[key] = value
        with self._shards_registered():
            result = self.module.load_state_dict(local, strict=strict, assign=False)
        self.after_load()
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient norm over every rank's shards; returns the total norm."""
        return clip.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)

    # -- the rest of torch's DDP / FSDP2 surface (issue #40, README "The torch surface") --------
    def register_comm_hook(self, state: object, hook: Any) -> None:
        common.not_supported("fully_shard", "register_comm_hook", common.INSTEAD_COLLECTIVE)

    def join(self, *args: Any, **kwargs: Any) -> Any:
        common.not_supported("fully_shard", "join", common.INSTEAD_JOIN)

    def set_reshard_after_forward(self, *args: Any, **kwargs: Any) -> None:
        common.not_supported(
            "fully_shard",
            "set_reshard_after_forward",
            "choose it when wrapping: zero_stage=3 frees each unit's gathered parameters after its "
            "forward (reshard_after_forward=True), zero_stage=1 or 2 keeps full parameters on every rank",
        )

    # -- checkpoints (parallel/shards.py) -------------------------------------------------------
    def local_shards(self) -> list[LocalShard]:
        return checkpoint_shards(self.module, self._local_shards())  # TP: TP-qualified names

    def _local_shards(self) -> list[LocalShard]:
        self._sync_params()
        out = []
        for name, piece in self._pieces.items():
            if piece.slot.replicated:
                out.append(LocalShard.replicated(name, piece.param, self.comm.rank, self.comm.size))
                continue
            write = (0, piece.length)
            out.append(LocalShard(name, piece.param, tuple(piece.slot.shape), piece.start, write))
        for name, p in self._frozen.items():
            out.append(LocalShard.replicated(name, p, self.comm.rank, self.comm.size))
        return out

    def local_buffers(self) -> list[LocalShard]:
        buffers = common.persistent_buffers(self.module)
        shards = [LocalShard.from_replica0(n, b, self.comm.rank) for n, b in buffers.items()]
        return checkpoint_shards(self.module, shards)

    def after_load(self) -> None:
        for unit in self.units:
            unit.mark_stale()  # ZeRO-1/2: gather the loaded shards before the next forward

    # -- swapping full parameters and shards -----------------------------------------------------
    def _use_full(self) -> None:
        for sub, attr, full, _piece in self._registrations:
            sub._parameters[attr] = full

    def _use_shards(self) -> None:
        for sub, attr, _full, piece in self._registrations:
            sub._parameters[attr] = piece

    def _open_step(self, grad: bool) -> None:
        """Before a forward: full parameters registered, ZeRO-1/2 shards gathered, the root gathered."""
        if self._step_open and self._in_backward:
            raise RuntimeError("fully_shard: forward called while a backward pass of this model runs")
        self._refuse_training_while_unsharded()
        if not self._step_open:
            self._sync_params()
            self._use_full()
            self._step_open = True
        self._sync_this_backward = self._sync
        self.peak_gathered_units = 0
        self._start_backward_bookkeeping()
        if self.root_unit is not None and self.stage == 3:
            self._gather(self.root_unit)

    def _close_step(self) -> None:
        """After the backward (or a forward without one): shards registered, ZeRO-3 memory freed.
        Not while unshard() holds the full parameters: reshard() ends that."""
        if not self._step_open or self._unsharded:
            return
        if self.stage == 3:
            # A prefetch no forward used (a unit called on its own outside a step prefetches the
            # next): let it land before its buffer is freed.
            for _gathered, handle in self._pending_gather.values():
                handle.wait()
            self._pending_gather.clear()
            for unit in self.units:
                unit.free_full()
        self._use_shards()
        self._step_open = False
        self._in_backward = False
        self._lazy_units = False

    def _sync_params(self) -> None:
        """ZeRO-1/2: all-gather the shards the optimizer changed since the last gather."""
        if self.stage == 3:
            return
        # One gather in flight while the previous is copied out: each holds a unit's rank-major
        # buffer, so gathering every unit at once held a whole model more (2.14 MB peak against
        # 1.75 MB in test_peak_bytes_of_a_step_stay_within_one_unit_and_fsdp2).
        pending: tuple[FlatUnit, torch.Tensor, Handle] | None = None
        for unit in [u for u in self.units if u.version() != u.synced_version]:
            gathered = torch.empty(unit.padded, dtype=unit.dtype, device=unit.device)
            handle = self.comm.all_gather(gathered, unit.send_shard(), async_op=True)
            if pending is not None:
                self._copy_out_synced(*pending)
            pending = (unit, gathered, handle)
        if pending is not None:
            self._copy_out_synced(*pending)

    @staticmethod
    def _copy_out_synced(unit: FlatUnit, gathered: torch.Tensor, handle: Handle) -> None:
        handle.wait()
        unit.copy_out(gathered, unit.full)
        unit.synced_version = unit.version()

    # -- parameter gathering (ZeRO-3) ----------------------------------------------------------
    def _start_gather(self, unit: FlatUnit) -> None:
        if self.stage != 3 or unit.gathered or unit.index in self._pending_gather:
            return
        # The all-gather lands in a buffer of its own (rank-major); `full` is regrown only when it
        # is copied out in _gather, so a prefetch holds one unit's bytes, as before.
        gathered = torch.empty(unit.padded, dtype=unit.dtype, device=unit.device)
        held = 1 + sum(
            1 for u in self.units if u.full.untyped_storage().nbytes() > 0 or u.index in self._pending_gather
        )
        self.peak_gathered_units = max(self.peak_gathered_units, held)
        handle = self.comm.all_gather(gathered, unit.send_shard(), async_op=True)
        self._pending_gather[unit.index] = (gathered, handle)

    def _gather(self, unit: FlatUnit) -> None:
        if self.stage != 3:
            return
        self._start_gather(unit)
        pending = self._pending_gather.pop(unit.index, None)
        if pending is not None:
            gathered, handle = pending
            handle.wait()
            unit.regrow_full()
            unit.copy_out(gathered, unit.full)
        unit.gathered = True

    def _neighbour(self, unit: FlatUnit, step: int) -> FlatUnit | None:
        pos = self._position[unit.index] + step
        return self.block_units[pos] if 0 <= pos < len(self.block_units) else None

    # -- hooks (common.weak_hook), by unit index ---------------------------------------------------
    def _grad_hook(self, index: int, slot: int, param: torch.Tensor) -> None:
        self._grad_flags.mark(self.units[index], slot)
        self._on_grad_ready(self.units[index])

    def _pre_forward_hook(self, index: int, module: nn.Module, args: Any) -> None:
        self._pre_forward(self.units[index])

    def _post_forward_hook(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self._post_forward(self.units[index], output)

    def _pre_backward_hook(self, index: int, grad: torch.Tensor) -> None:
        self._pre_backward(self.units[index])

    def _pre_forward(self, unit: FlatUnit) -> None:
        if not self._step_open:
            raise RuntimeError(
                f"fully_shard: unit {unit.label} ran outside the wrapped model's forward; call the module "
                "fully_shard returned, not its .module"
            )
        self._refuse_training_while_unsharded()
        self._gather(unit)
        following = self._neighbour(unit, 1)
        if self.prefetch and following is not None:
            self._start_gather(following)

    def _post_forward(self, unit: FlatUnit, output: Any) -> None:
        if not torch.is_grad_enabled():
            if not self._in_backward and self.stage == 3 and not self._unsharded:
                unit.free_full()
            return
        if not self._in_backward and self.stage == 3:
            for t in common.tensors_in(output):
                if t.requires_grad:
                    t.register_hook(common.weak_hook(self, "_pre_backward_hook", unit.index))
        # The last unit's backward comes first: keep it instead of gathering it straight back.
        if self.stage == 3 and not self._in_backward and self._neighbour(unit, 1) is not None:
            unit.free_full()

    def _pre_backward(self, unit: FlatUnit) -> None:
        self._backward_started()
        if unit.index in self._prebackward_done and unit.gathered:
            return
        self._prebackward_done.add(unit.index)
        self._gather(unit)
        previous = self._neighbour(unit, -1)
        if self.prefetch and previous is not None:
            self._start_gather(previous)

    # -- gradient reduction --------------------------------------------------------------------
    def _backward_started(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            common.queue_after_backward(self._finish_backward)

    def _start_backward_bookkeeping(self) -> None:
        for unit in self.units:
            unit.grads_pending = len(unit.slots)
        self._ready.clear()
        self._reductions.clear()
        self._next_reduce = 0
        self._next_finish = 0
        self._prebackward_done.clear()

    def _on_grad_ready(self, unit: FlatUnit) -> None:
        if not self._step_open:
            raise RuntimeError(
                "fully_shard: a gradient arrived in a backward pass whose forward did not go through the "
                "wrapped model (call the module fully_shard returned), or backward ran twice after one "
                "forward"
            )
        self._backward_started()
        unit.grads_pending -= 1
        if unit.grads_pending == 0:
            self._unit_ready(unit)

    def _unit_ready(self, unit: FlatUnit) -> None:
        if self.stage == 1:
            grad_full = self._grad_full[unit.index]
            for s in unit.slots:  # accumulate locally; re-point .grad at the buffer if autograd replaced it
                view = grad_full[s.offset : s.offset + s.numel].view(s.shape)
                if s.param.grad is not None and s.param.grad.data_ptr() != view.data_ptr():
                    view.add_(s.param.grad)
                s.param.grad = view
            if not self._sync_this_backward:
                return
            flat = unit.flatten_grads()  # copy-in to the rank-major layout
            grad_full.zero_()  # the full parameters' .grad are views of it: zero for the next step
        else:
            # The reductions launched so far had this unit's backward to run: take them in, which
            # frees their flat gradients before this unit's is allocated. So a rank holds at most
            # one unit's gradients and one flat gradient at a time, not every unit's flat gradient
            # until backward ends (4 bytes per parameter more at the end of backward).
            self._finish_launched()
            if self.stage == 3 and unit is not self.root_unit:
                unit.free_full()  # its backward is done: free its parameters before the copy below
            flat = unit.flatten_grads()
            for s in unit.slots:
                s.param.grad = None
        self._reductions[unit.index] = (flat, flat.new_empty(unit.shard_len), None)
        self._ready.add(unit.index)
        self._launch_ready()

    def _launch_ready(self) -> None:
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].index in self._ready:
            index = order[self._next_reduce].index
            flat, out, _ = self._reductions[index]
            self._reductions[index] = (flat, out, self.comm.reduce_scatter_sum(out, flat, async_op=True))
            self._next_reduce += 1

    def _finish_backward(self) -> None:
        if self.stage == 1 and not self._sync_this_backward:
            self._in_backward = False
            return  # no_sync: the full gradients keep accumulating; the step stays open
        for unit in self._reduce_order:  # units that took no part in this backward
            if unit.index not in self._ready:
                self._unit_ready(unit)
        self._launch_ready()
        self._grad_flags.launch()  # after every unit's reduce-scatter, on every rank
        self._finish_launched()
        if self.offload is not None:  # the optimizer reads the host gradients after backward
            wait_for_copies(self.units[0].device)
        self._grad_flags.apply()
        self._close_step()

    def _finish_launched(self) -> None:
        """Wait for the reduce-scatters launched so far, in launch order; add each to its unit's
        shard gradients and let go of its full flat gradient (ZeRO-2/3: freed here)."""
        order = self._reduce_order
        while self._next_finish < self._next_reduce:
            unit = order[self._next_finish]
            flat, out, handle = self._reductions.pop(unit.index)
            assert handle is not None
            handle.wait()
            self._grad_flags.note(unit)
            unit.add_to_shard_grads(out.div_(self.comm.size))
            for piece in unit.pieces:
                if piece.param.grad is not None and not piece.slot.replicated:
                    clip.mark(piece.param.grad, self.comm, clip.split_of(piece.slot.param))
            del flat
            self._next_finish += 1


def auto_units(model: nn.Module) -> list[nn.Module]:
    """The units `fully_shard` picks when `units=None` (see the module docstring)."""
    blocks = common.blocks_in_order(model)
    if blocks is not None:
        return blocks
    return common.repeated_blocks(model)


def _check_units(model: nn.Module, units: list[nn.Module]) -> None:
    ids = {id(u) for u in units}
    if len(ids) != len(units):
        raise ValueError("fully_shard: a module appears twice in units")
    if model in units:
        raise ValueError("fully_shard: the model itself is the root unit; list only its submodules in units")
    names = common.module_names(model)
    for unit in units:
        for sub in unit.modules():
            if sub is not unit and id(sub) in ids:
                raise ValueError(
                    f"fully_shard: unit {names.get(id(sub))} is inside unit {names.get(id(unit))}; "
                    "units must not nest (the model itself is the root unit around them)"
                )


def _check_offload(offload: str | None) -> None:
    if offload is None or offload == "optimizer":
        return
    if offload == "params":
        raise common.NotSupported(
            'fully_shard: offload="params" (parameters on the host between steps) is not supported; '
            'use offload="optimizer", which keeps the master weights, gradients and optimizer state '
            "on the host (ZeRO-Offload) and only the parameter shards the forward gathers on the device"
        )
    raise ValueError(f'fully_shard: offload must be None or "optimizer", got {offload!r}')


def fully_shard(
    model: nn.Module,
    *,
    zero_stage: int = 3,
    units: Iterable[nn.Module | str] | None = None,
    collective: str = "auto",
    mixed_precision: str | None = None,
    prefetch: bool = True,
    broadcast_buffers: bool = True,
    offload: str | None = None,
    group: Any = None,
) -> FullyShardedModule:
    """Shard `model`'s training state over `group` (default: the whole default process group).

    zero_stage: 1 shards optimizer state; 2 also gradients; 3 also parameters (ZeRO paper).
    units: the modules whose parameters are gathered and reduced together (objects or qualified
        names); None picks them (see the module docstring) and logs which.
    collective: "auto", "ring", "hd", "direct" (dtjob's collectives) or "native" (torch's).
    mixed_precision: None, "bf16" or "fp16": the forward runs under autocast; parameters,
        gradients and their reduction keep the parameters' dtype (fp32 master weights).
    prefetch: ZeRO-3 gathers the next unit while the current one computes.
    broadcast_buffers: copy rank 0's buffers (BatchNorm's running statistics, ...) to every rank
        before a forward, as torch's DDP: before the first, and before one that follows a training
        forward (see common.BufferBroadcast). Checkpoints hold rank 0's buffers either way.
    offload: None, or "optimizer" (ZeRO-Offload): the shards the optimizer holds, their gradients
        and so the optimizer's state and step live in host memory (see the module docstring).
    A parameter no rank got a gradient for keeps `.grad = None` (see the module docstring): no
    find_unused_parameters flag to set; the cost is one all-reduce of 4 bytes per parameter per
    backward.
    Every rank passes an identically constructed model; rank 0's parameters are broadcast.
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError("fully_shard() needs torch.distributed.init_process_group() to be called first")
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"fully_shard: zero_stage must be 1, 2 or 3, got {zero_stage!r}")
    _check_offload(offload)
    if isinstance(model, common.Wrapper):
        raise ValueError(f"fully_shard: the model is already wrapped ({type(model).__name__})")
    comm = Comm(collective, group)
    check_wrappable(model, "fully_shard", comm)  # a tensor_parallel model: group= its DP group
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("fully_shard: the model has no parameter that requires a gradient")
    chosen = auto_units(model) if units is None else common.resolve_modules(model, units, "fully_shard units")
    _check_units(model, chosen)
    wrapped = FullyShardedModule(
        model,
        comm,
        zero_stage=zero_stage,
        units=chosen,
        prefetch=prefetch,
        mixed_precision=mixed_precision,
        broadcast_buffers=broadcast_buffers,
        offload=offload,
    )
    if wrapped.comm.rank == 0:
        labels = [u.label for u in wrapped.block_units]
        shown = labels if len(labels) <= 4 else [labels[0], "...", labels[-1]]
        root = [s.name for s in wrapped.root_unit.slots] if wrapped.root_unit else []
        log.info(
            "fully_shard: ZeRO-%d%s, %d units (%s) and a root unit of %d parameters%s",
            zero_stage,
            f" offload={offload}" if offload else "",
            len(labels),
            ", ".join(shown) or "none",
            len(root),
            f" ({', '.join(root[:3])}{', ...' if len(root) > 3 else ''})" if root else "",
        )
    return wrapped
