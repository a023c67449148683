"""`pipeline(model, stages=P)`: the model cut into P stages, micro-batches flowing between ranks.

    pipe = pipeline(model, stages=2, microbatches=4, schedule="1f1b")
    optimizer = torch.optim.AdamW(pipe.parameters())     # this stage's parameters
    loss = pipe.step(batch, targets)                       # forward + backward of the whole batch
    optimizer.step(); optimizer.zero_grad()
    loss, outputs = pipe.eval_step(batch, targets)         # forward only, between training steps

Layout for world size W = D * P: rank = replica * P + stage. The P ranks of a replica form a
pipeline (activations forward, their gradients backward, point-to-point); the D ranks holding the
same stage average that stage's gradients with dtjob's collectives. Every rank of a replica gets
the same slice of the batch: stage 0 needs the inputs, the last stage the targets, the others the
inputs' shapes.

How a stage runs any model (one that is not a plain sequence of blocks, such as a Hugging Face
model, whose forward also builds masks and position embeddings): every stage calls the model's
own forward on the micro-batch. On stage s, modules that belong to earlier stages are replaced by
stand-ins returning zeros of the shapes their real outputs had (the previous stage sends those
shapes along), so the glue code between them runs as usual; when the forward reaches boundary s,
its arguments are replaced by what stage s - 1 sent: every tensor of the boundary call (hidden
states, and also masks and position embeddings, however many); when it reaches boundary s + 1, the
tensors of that call are sent on and the forward stops. The last stage runs to the end and
computes the loss: `loss_fn(output, targets)`, or the output's own `.loss` (Hugging Face models
given `labels`). A stand-in output that the stage still uses after its boundary (a skip connection
around the cut) would be silently wrong, so its zeros require grad and the first step raises if
any of them receives a gradient. What crosses a boundary (tensors of any layout, tuples/lists/dicts
of them, constants) is in boundary.py.

Parameters without a gradient: a frozen parameter (requires_grad=False) belongs to its stage's
state dicts and checkpoints but gets no gradient buffer. A trainable one that no micro-batch gave a
gradient on any replica of its stage (a layer the forward skipped, an expert no token chose) ends
the step with `.grad` None, as in one process, so the optimizer skips it (no weight decay, no
moment update). The replicas agree on it by one all-reduce of a flag per parameter per step, as
torch DDP's find_unused_parameters=True does; a replica that did not use it contributes zeros to
the average, as there.

Between two actions a stage sends what the first produced and receives what the second needs in
one batch (schedule.exchanges, wire.py): under NCCL, unbatched sends and receives facing each other
between two stages deadlock once tensors outgrow NCCL's buffers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from dtjob.trainer.collectives import abort
from dtjob.trainer.parallel import clip, common, guard, syncbn
from dtjob.trainer.parallel.comm import Comm, GroupMaker, control_group
from dtjob.trainer.parallel.pp import boundary, wire
from dtjob.trainer.parallel.pp.schedule import P2P, exchanges
from dtjob.trainer.parallel.pp.split import auto_split, plan, spec_of, zeros_of
from dtjob.trainer.parallel.shards import LocalShard
from dtjob.trainer.parallel.tp.module import check_wrappable, checkpoint_shards

LossFn = Callable[[Any, Any], torch.Tensor]


class _StageDone(BaseException):
    """Raised at the next stage's boundary: this stage's part of the forward is over. A
    BaseException, so that no `except Exception` in a model's forward swallows it."""


def default_loss(output: Any, targets: Any) -> torch.Tensor:
    """The output's own `.loss` (or ["loss"]) if it has one, else cross-entropy of logits."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is not None:
        return loss
    logits = getattr(output, "logits", output)
    if targets is None or not isinstance(logits, torch.Tensor):
        raise ValueError(
            "pipeline: the model's output has no .loss and no targets were given; pass targets to step() "
            "(and loss_fn=) or inputs that make the model compute its loss (labels=...)"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _chunks(value: Any, parts: int, what: str) -> list[Any]:
    """`value` (a tensor, or tuples/lists/dicts of them) cut into `parts` along dim 0."""
    leaves, spec = pytree.tree_flatten(value)
    cut: list[list[Any]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] % parts:
                n = leaf.shape[0] if leaf.dim() else 0
                raise ValueError(
                    f"pipeline: a batch of {n} samples does not split into {what}={parts} equal parts"
                )
            cut.append(list(leaf.chunk(parts)))
        else:
            cut.append([leaf] * parts)
    return [pytree.tree_unflatten([c[i] for c in cut], spec) for i in range(parts)]


def _own_loss(output: Any) -> Any:
    loss = getattr(output, "loss", None)
    return output.get("loss") if loss is None and isinstance(output, dict) else loss


def _concat(outputs: list[Any]) -> Any:
    """Micro-batch outputs as one: tensors concatenated along dim 0, scalars (a micro-batch's
    mean loss) averaged, anything else taken from the first."""
    leaves = [pytree.tree_flatten(o)[0] for o in outputs]
    spec = pytree.tree_flatten(outputs[0])[1]
    merged = []
    for parts in zip(*leaves, strict=True):
        first = parts[0]
        if isinstance(first, torch.Tensor):
            merged.append(torch.cat(parts) if first.dim() else torch.stack(parts).mean())
        else:
            merged.append(first)
    return pytree.tree_unflatten(merged, spec)


def _call(module: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    return module(inputs)


class ActivationMeter:
    """Counts the bytes autograd saves for backward (parameters excluded) and their peak."""

    def __init__(self, param_ptrs: set[int]) -> None:
        self.param_ptrs = param_ptrs
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.untyped_storage().data_ptr() in self.param_ptrs:
            return t
        return _Saved(t, self)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed


class _Saved:
    __slots__ = ("meter", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter) -> None:
        self.tensor = tensor
        self.meter = meter
        self.nbytes = tensor.numel() * tensor.element_size()
        meter.live += self.nbytes
        meter.peak = max(meter.peak, meter.live)

    def __del__(self) -> None:
        self.meter.live -= self.nbytes


class _Microbatch:
    """What one micro-batch leaves on this stage between its messages, forward and backward."""

    def __init__(self) -> None:
        self.received: list[torch.Tensor] = []  # from the previous stage
        self.header: dict[str, Any] = {}  # its stand-in output specs, and the boundary call's rest
        self.outgoing: list[torch.Tensor] = []  # the next boundary call's tensors, to send
        self.outgoing_header: dict[str, Any] = {}
        self.sent: list[torch.Tensor] = []  # those of `outgoing` that require grad
        self.grads_in: list[torch.Tensor] = []  # their gradients, from the next stage
        self.grads_out: list[torch.Tensor] = []  # gradients of `received` that require grad
        self.loss: torch.Tensor | None = None  # last stage
        self.output: Any = None  # last stage, eval_step
        self.stand_ins: list[torch.Tensor] = []


_INSTEAD_ACCUMULATE = (
    "step() accumulates over its micro-batches and reduces once: for a larger batch per "
    "optimizer step, pass a larger batch or more microbatches= to pipeline()"
)
_INSTEAD_STAGES = (
    "each stage holds its own parameters, unsharded; for the whole model's weights use "
    "dtjob.trainer.parallel.full_state_dict(model)"
)


class Pipeline(common.Wrapper):
    """The object `pipeline` returns; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        *,
        stages: int,
        microbatches: int,
        schedule: str,
        boundaries: Sequence[str],
        loss_fn: LossFn,
        collective: str,
        mixed_precision: str | None,
        broadcast_buffers: bool = True,
        comm: Comm | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm if comm is not None else Comm(collective, None)  # the ranks it spans
        world, rank = self.comm.size, self.comm.rank  # ranks of the group: replica * P + stage
        P = stages
        self.module = module
        self.microbatches = microbatches
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.mixed_precision = mixed_precision
        self.stages, self.replicas = P, world // P
        self.stage, self.replica = rank % P, rank // P
        # Every rank must create every group, in the same order.
        self._groups = GroupMaker(self.comm.group)
        pp_groups = [self._groups.new_group([d * P + s for s in range(P)]) for d in range(self.replicas)]
        dp_groups = [self._groups.new_group([d * P + s for d in range(self.replicas)]) for s in range(P)]
        self.pp_comm = Comm(collective, pp_groups[self.replica])
        self.dp_comm = Comm(collective, dp_groups[self.stage])
        self._control = control_group()
        self.control_comm = Comm("native", self._control)
        # Default-group ranks (point-to-point takes those).
        self.prev_rank = self.comm.global_rank(rank - 1) if self.stage > 0 else None
        self.next_rank = self.comm.global_rank(rank + 1) if self.stage < P - 1 else None

        common.broadcast_from_rank0([*module.parameters(), *module.buffers()], self.comm)
        # A stage failing ends its peers' waits, those on headers (the control group) included.
        headers = self._control or dist.group.WORLD
        if headers is not None:
            abort.register(headers)
        self.plan = plan(module, boundaries)
        # This stage's parameters (for state dicts and checkpoints), and those that train.
        self._stage_params = [
            (n, p) for n, p in module.named_parameters() if self.stage in self.plan.owners[id(p)]
        ]
        self._owned = [(n, p) for n, p in self._stage_params if p.requires_grad]
        self._device = self._stage_params[0][1].device if self._stage_params else torch.device("cpu")
        for i, (_, p) in enumerate(self._owned):
            guard.mark(p, "pipeline")
            p.register_post_accumulate_grad_hook(common.weak_hook(self, "_mark_used", i))
        # Which trainable parameters received a gradient this step (see _drop_unused_grads).
        self._used = torch.zeros(len(self._owned), device=self.dp_comm.device)
        self._had_grad: list[bool] = []
        self._tie_comms = self._tie_groups(module)
        # This stage's buffers, from replica 0 of the stage (its data-parallel group).
        owner, stage = self.plan.buffer_owner, self.stage
        self._buffer_broadcast = common.BufferBroadcast(
            module, self.dp_comm, broadcast_buffers, lambda name: owner.get(name) == stage
        )
        syncbn.bind_sync_batchnorms(module, self.dp_comm, "pipeline")
        self._free_others(module)
        self._install_hooks(module)

        params = [p for _, p in self._owned]
        self.grad_flat = torch.zeros(sum(p.numel() for p in params), device=self._device)
        self._grad_views: list[torch.Tensor] = []
        offset = 0
        for name, p in self._owned:
            if p.dtype != torch.float32:
                raise TypeError(f"pipeline: parameter {name} is {p.dtype}; the pipeline keeps fp32 weights")
            self._grad_views.append(self.grad_flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.meter = ActivationMeter({p.untyped_storage().data_ptr() for p in params})
        self.peak_live_microbatches: float | None = None
        self.last_step_busy_s = 0.0
        self.last_step_total_s = 0.0
        self._checked_stand_ins = False
        self._specs: dict[str, Any] = {}  # stand-in name -> the output spec of the micro-batch at hand
        self._mb: _Microbatch | None = None
        self._loss_scale: torch.Tensor | None = None  # fp16's, for the step at hand
        self._forward_only = False  # eval_step's schedule at hand
        self._microbatch = 0  # the micro-batch at hand
        self._first_crossing: boundary.Crossing | None = None  # micro-batch 0's, at the next boundary
        clip.install()

    # -- setup -----------------------------------------------------------------------------------
    def _tie_groups(self, module: nn.Module) -> list[tuple[Comm, list[nn.Parameter], bool]]:
        """Per set of stages sharing parameters: (their group, this stage's shared parameters,
        whether this stage is the first of them, which counts them in norms and checkpoints)."""
        sets = sorted({tuple(sorted(o)) for o in self.plan.owners.values() if len(o) > 1})
        result = []
        for stage_set in sets:
            groups = [
                self._groups.new_group([d * self.stages + s for s in stage_set]) for d in range(self.replicas)
            ]
            if self.stage in stage_set:
                shared = [p for _, p in self._owned if tuple(sorted(self.plan.owners[id(p)])) == stage_set]
                result.append(
                    (Comm(self.comm.algorithm, groups[self.replica]), shared, self.stage == stage_set[0])
                )
        return result

    def _free_others(self, module: nn.Module) -> None:
        """Parameters of other stages are never touched here: replace them by empty ones."""
        placeholder: dict[int, nn.Parameter] = {}
        for sub in module.modules():
            for attr, p in list(sub._parameters.items()):
                if p is None or self.stage in self.plan.owners[id(p)]:
                    continue
                if id(p) not in placeholder:
                    placeholder[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device), False)
                sub._parameters[attr] = placeholder[id(p)]

    def _install_hooks(self, module: nn.Module) -> None:
        # Through weak references (common.weak_hook): the module holds its hooks, and a hook
        # holding this wrapper would keep a dropped pipeline alive until a gc.collect().
        s, bounds = self.stage, self.plan.boundaries
        weak = common.weak_hook
        if s > 0:
            first = module.get_submodule(bounds[s - 1])
            first.register_forward_pre_hook(weak(self, "_substitute"), with_kwargs=True)
            for name in self.plan.stand_ins[s]:
                sub = module.get_submodule(name)
                sub.forward = weak(self, "_stand_in", name)
        if s < self.stages - 1:
            module.get_submodule(bounds[s]).register_forward_pre_hook(
                weak(self, "_capture"), with_kwargs=True
            )
            for name in self.plan.stand_ins[s + 1]:
                module.get_submodule(name).register_forward_hook(weak(self, "_record", name))

    def _stand_in(self, name: str, *_args: Any, **_kwargs: Any) -> Any:
        """The forward of module `name`, an earlier stage's, on this stage: zeros shaped as its
        output was on the stage that ran it."""
        spec = self._specs.get(name)
        if spec is None:
            raise RuntimeError(
                f"pipeline stage {self.stage}: module {name} (an earlier stage's) ran, but the previous "
                "stage did not see it run before its boundary; choose split points in forward order"
            )
        out = zeros_of(spec, self._device)
        assert self._mb is not None
        self._mb.stand_ins.extend(common.tensors_in(out))
        return out

    def _record(self, name: str, _module: nn.Module, _args: Any, output: Any) -> None:
        self._specs[name] = spec_of(output)

    # -- the boundaries ------------------------------------------------------------------------
    def _substitute(self, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        assert self._mb is not None
        name = self.plan.boundaries[self.stage - 1]
        return boundary.substitute(name, self.stage, args, kwargs, self._mb.received, self._mb.header)

    def _capture(self, _module: nn.Module, args: Any, kwargs: Any) -> None:
        assert self._mb is not None and self.next_rank is not None
        name = self.plan.boundaries[self.stage]
        crossing = boundary.capture(name, args, kwargs)
        if self._first_crossing is None:
            self._first_crossing = crossing
        else:
            boundary.check_constants(name, self._first_crossing, crossing, self._microbatch)
        specs = {n: self._specs[n] for n in self.plan.stand_ins[self.stage + 1] if n in self._specs}
        self._mb.outgoing = crossing.tensors
        self._mb.outgoing_header = {
            "specs": specs,
            "constants": crossing.constants,
            "layout": crossing.layout,
        }
        self._mb.sent = [t for t in crossing.tensors if t.requires_grad]
        raise _StageDone

    # -- the module interface -------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("pipeline: run a whole batch with step(inputs, targets), not a forward call")

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        pre = prefix + "." if prefix else ""
        for name, p in self._stage_params:
            yield pre + name, p

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This stage's parameters and persistent buffers under their original names (the whole
        model: full_state_dict)."""
        out: dict[str, Any] = {name: p.detach() for name, p in self._stage_params}
        for name, b in common.persistent_buffers(self.module).items():
            if self.plan.buffer_owner.get(name) == self.stage:
                out[name] = b.detach()
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Take this stage's tensors from a state dict of the plain model (or of this stage);
        strict: every one of them must be there."""
        mine = self.state_dict()
        missing = [k for k in mine if k not in state_dict]
        if strict and missing:
            raise KeyError(f"pipeline stage {self.stage}: the state dict lacks {missing[:5]}")
        with torch.no_grad():
            for key, tensor in mine.items():
                if key in state_dict:
                    tensor.copy_(state_dict[key])
        return None

    # -- the rest of torch's DDP / FSDP2 surface (issue #40, README "The torch surface") --------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient norm over every stage's parameters; returns the total norm."""
        return clip.clip_grad_norm_(list(self.parameters()), max_norm, norm_type)

    def no_sync(self) -> Any:
        common.not_supported("pipeline", "no_sync", _INSTEAD_ACCUMULATE)

    def set_requires_gradient_sync(self, *args: Any, **kwargs: Any) -> None:
        common.not_supported("pipeline", "set_requires_gradient_sync", _INSTEAD_ACCUMULATE)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        common.not_supported("pipeline", "register_comm_hook", "collective= chooses how the replicas reduce")

    def join(self, *args: Any, **kwargs: Any) -> Any:
        common.not_supported("pipeline", "join", common.INSTEAD_JOIN)

    def set_reshard_after_forward(self, *args: Any, **kwargs: Any) -> None:
        common.not_supported("pipeline", "set_reshard_after_forward", _INSTEAD_STAGES)

    def unshard(self, *args: Any, **kwargs: Any) -> Any:
        common.not_supported("pipeline", "unshard", _INSTEAD_STAGES)

    def reshard(self) -> None:
        common.not_supported("pipeline", "reshard", _INSTEAD_STAGES)

    @property
    def data_parallel_rank(self) -> int:
        return self.replica

    @property
    def data_parallel_size(self) -> int:
        return self.replicas

    def step(self, inputs: Any, targets: Any = None, scaler: torch.amp.GradScaler | None = None) -> float:
        """Forward and backward of this replica's batch in micro-batches; the gradients of this
        stage's parameters are averaged over the replicas (and summed over the stages that share a
        tied weight) when it returns. Returns the mean loss over the global batch, on every rank.

        scaler: fp16's loss scaling, required with mixed_precision="fp16" (its gradients underflow
        without it); the last stage scales the loss by it, so every stage's gradients come out
        scaled, and scaler.step(optimizer) unscales them. It must be a ShardedGradScaler over the
        whole world: whether any gradient overflowed must be agreed on by every stage and replica,
        or some would skip a step that others take, and their scales would part."""
        if not torch.is_grad_enabled():
            # Every stage raises here, before any message: none is left waiting for another.
            raise RuntimeError(
                "pipeline: step() trains, and runs under torch.no_grad() (or inference_mode) here; for a "
                "forward-only pass (evaluation) call pipe.eval_step(inputs, targets) instead"
            )
        start = time.perf_counter()
        self.last_step_busy_s = 0.0
        self._loss_scale = self._scale_of(scaler)
        self._prepare_grads()
        self._buffer_broadcast.before_forward(True)
        self.meter.live = self.meter.peak = 0
        loss, per_microbatch, _ = self._run_schedule(inputs, targets, self.schedule)
        if per_microbatch:
            self.peak_live_microbatches = self.meter.peak / per_microbatch
        if self.replicas > 1:
            self.dp_comm.all_reduce_sum(self.grad_flat)
            self.grad_flat.div_(self.replicas)
        for comm, shared, first in self._tie_comms:
            for p in shared:
                assert p.grad is not None
                comm.all_reduce_sum(p.grad)
                if not first:
                    clip.mark(p.grad, clip.DUPLICATE)
        self._drop_unused_grads()
        # The loss lives on the last stages: sum theirs over the world, average over replicas.
        self.comm.all_reduce_sum(loss)
        self.last_step_total_s = time.perf_counter() - start
        return float(loss[0].item()) / self.replicas

    def _scale_of(self, scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        if scaler is None or not scaler.is_enabled():
            if self.mixed_precision == "fp16":
                raise ValueError(
                    "pipeline: mixed_precision='fp16' needs loss scaling; pass "
                    "step(..., scaler=ShardedGradScaler(device_type)) and call scaler.step(optimizer)"
                )
            return None
        if not isinstance(scaler, ShardedGradScaler) or scaler.process_group not in (None, dist.group.WORLD):
            raise TypeError(
                "pipeline: the scaler must be a torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler "
                "over the whole world, so that every stage skips the steps where any stage overflowed"
            )
        # scaler.scale() of a one is the scale, and initialises it on every stage, including those
        # that scale no loss of their own (scaler.step() needs it).
        return scaler.scale(torch.ones((), device=self._device))

    def eval_step(self, inputs: Any, targets: Any = None) -> tuple[float | None, Any]:
        """A forward-only pass of this replica's batch, in micro-batches, without autograd: no
        gradient, optimizer state or training-mode switch is touched, so it can run between two
        training steps. Call it on every rank, as step(). Returns (loss, outputs): the mean loss
        over the global batch on every rank (None where the model computes no loss: no targets,
        no .loss), and on the last stage the model's outputs for this replica's batch (the
        micro-batches' tensors concatenated along dim 0, scalars averaged; None elsewhere).
        Dropout and the like follow the module's mode: call pipe.eval() first, as with torch."""
        self._buffer_broadcast.before_forward(False)
        with torch.no_grad():
            loss, _, outputs = self._run_schedule(inputs, targets, "forward")
        self.comm.all_reduce_sum(loss)
        count = float(loss[1].item())
        mean = None if count == 0 else float(loss[0].item()) / self.replicas
        return mean, _concat(outputs) if outputs else None

    def _mark_used(self, index: int, _param: torch.Tensor) -> None:
        self._used[index] = 1

    def _drop_unused_grads(self) -> None:
        """A parameter that received no gradient from any micro-batch on any replica of its stage
        (frozen by the control flow, a mixture-of-experts' expert no token chose) gets None, as in
        one process (an optimizer skips it: no weight decay, no moment update). The replicas agree
        in one all-reduce of a flag per parameter, as torch DDP's find_unused_parameters does; so
        do the stages sharing a tied parameter."""
        if self.replicas > 1:
            self.dp_comm.all_reduce_sum(self._used)
        for comm, shared, _first in self._tie_comms:
            ids = {id(p) for p in shared}
            index = torch.tensor(
                [i for i, (_, p) in enumerate(self._owned) if id(p) in ids], dtype=torch.long
            )
            if not len(index):
                continue  # every shared parameter frozen: the same on each of these stages
            flags = self._used[index]
            comm.all_reduce_sum(flags)
            self._used[index] = flags
        for (_, p), used, had in zip(self._owned, self._used.tolist(), self._had_grad, strict=True):
            if not used and not had:
                p.grad = None

    def _prepare_grads(self) -> None:
        """Each parameter's .grad a view of the flat buffer, keeping what accumulated (torch's
        semantics: gradients add up until the user zeroes them)."""
        self._used.zero_()
        self._had_grad = [p.grad is not None for _, p in self._owned]
        for (_, p), view in zip(self._owned, self._grad_views, strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
            clip.mark(view, self.pp_comm, clip.split_of(p))

    def _run_schedule(self, inputs: Any, targets: Any, schedule: str) -> tuple[torch.Tensor, int, list[Any]]:
        """The step's actions and messages. Returns the sum of this stage's micro-batch losses and
        how many it computed (a float64 pair), the bytes a micro-batch's forward saved, and (on
        the last stage of a forward-only schedule) each micro-batch's output."""
        M = self.microbatches
        micro_inputs = _chunks(inputs, M, "microbatches")
        micro_targets = _chunks(targets, M, "microbatches") if targets is not None else [None] * M
        state: dict[int, _Microbatch] = {}
        self._header_sends: list[Any] = []
        self._forward_only = schedule == "forward"
        self._first_crossing = None
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.comm.device)
        per_microbatch = 0
        outputs: list[Any] = []
        for step in exchanges(schedule, self.stage, self.stages, M):
            with abort.guard():  # a peer that failed: GangAborted naming it, not gloo's words
                self._exchange(step.exchange, state)
            if step.action is None:
                continue
            m = self._microbatch = step.action.microbatch
            mb = state.setdefault(m, _Microbatch())
            if step.action.kind == "F":
                before = self.meter.live
                try:
                    self._forward(mb, micro_inputs[m], micro_targets[m])
                except boundary.CrossingError as err:
                    self._send_error(str(err))  # the next stage waits for this micro-batch
                    raise
                per_microbatch = per_microbatch or self.meter.live - before
                if mb.loss is not None:
                    loss_sum += torch.stack([mb.loss.detach().to(loss_sum), torch.ones_like(loss_sum[0])])
                if self._forward_only and self.next_rank is None:
                    outputs.append(mb.output)
                    del state[m]
            else:
                self._backward(mb)
                if self.prev_rank is None:
                    del state[m]  # nothing to send back
        for work in self._header_sends:
            work.wait()
        self._checked_stand_ins = self._checked_stand_ins or not self._forward_only
        return loss_sum, per_microbatch, outputs

    def _exchange(self, ops: list[P2P], state: dict[int, _Microbatch]) -> None:
        """One batch of messages (schedule.exchanges). The headers of this batch's activations go
        out before this stage reads any header, which may block (wire.py)."""
        base = self.replica * self.stages
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[torch.Tensor, int]] = []
        for op in ops:
            if op.op != "send":
                continue
            mb, peer = state[op.microbatch], self.comm.global_rank(base + op.peer)
            if op.kind == "F":
                self._header_sends += wire.send_header(
                    self.control_comm, mb.outgoing, mb.outgoing_header, peer
                )
                sends += [(t, peer) for t in mb.outgoing]
                mb.outgoing = []
                if self._forward_only:
                    del state[op.microbatch]  # no backward: this is its last message
            else:
                sends += [(g, peer) for g in mb.grads_out]
                del state[op.microbatch]  # its backward is done, and this is its last message
        flags: list[tuple[_Microbatch, list[bool]]] = []
        for op in ops:
            peer = self.comm.global_rank(base + op.peer)  # default-group ranks, as p2p takes
            if op.op == "recv" and op.kind == "F":
                mb = state[op.microbatch] = _Microbatch()
                mb.received, requires_grad, mb.header = wire.recv_header(
                    self.control_comm, peer, self._device
                )
                if "error" in mb.header:  # the previous stage raised instead of sending
                    self._send_error(mb.header["error"])
                    raise RuntimeError(f"pipeline stage {self.stage}: {mb.header['error']}")
                flags.append((mb, requires_grad))
                recvs += [(t, peer) for t in mb.received]
            elif op.op == "recv":
                mb = state[op.microbatch]
                # Dense, whatever the activation's strides (T5's position bias is a transposed
                # view): a receive needs a contiguous tensor.
                mb.grads_in = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in mb.sent]
                recvs += [(g, peer) for g in mb.grads_in]
        wire.exchange(self.comm, sends, recvs)
        for mb, requires_grad in flags:
            for t, flag in zip(mb.received, requires_grad, strict=True):
                t.requires_grad_(flag)

    def _send_error(self, message: str) -> None:
        """Tell the next stage, waiting for an activation's header, that this stage raises
        `message` instead: it raises too, and tells the stage after it."""
        if self.next_rank is not None:
            for work in wire.send_header(self.control_comm, [], {"error": message}, self.next_rank):
                work.wait()

    def _forward(self, mb: _Microbatch, inputs: Any, targets: Any) -> None:
        self._mb = mb
        self._specs.update(mb.header.get("specs", {}))
        t0 = time.perf_counter()
        saving = torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
        try:
            with saving, common.autocast(self.mixed_precision, self._device):
                output = _call(self.module, inputs)
                if self.next_rank is not None:
                    raise RuntimeError(
                        f"pipeline stage {self.stage}: the forward ended without calling boundary "
                        f"{self.plan.boundaries[self.stage]}; split at modules the forward calls"
                    )
                if self._forward_only:
                    mb.output = output
                    if targets is None and _own_loss(output) is None:
                        return  # nothing to compute a loss from: eval_step returns None
                mb.loss = self.loss_fn(output, targets) / self.microbatches
        except _StageDone:
            pass
        finally:
            self._mb = None
        self.last_step_busy_s += time.perf_counter() - t0

    def _backward(self, mb: _Microbatch) -> None:
        t0 = time.perf_counter()
        if mb.loss is not None:
            (mb.loss if self._loss_scale is None else mb.loss * self._loss_scale).backward()
        elif mb.sent:
            torch.autograd.backward(mb.sent, mb.grads_in)
        mb.grads_in = []
        self.last_step_busy_s += time.perf_counter() - t0
        back = [t for t in mb.received if t.requires_grad]
        mb.grads_out = [t.grad if t.grad is not None else torch.zeros_like(t) for t in back]
        if not self._checked_stand_ins:
            self._check_stand_ins(mb)

    def _check_stand_ins(self, mb: _Microbatch) -> None:
        for t in mb.stand_ins:
            if t.grad is not None and bool(t.grad.ne(0).any()):
                raise RuntimeError(
                    f"pipeline stage {self.stage}: the output of a module of an earlier stage is used after "
                    f"boundary {self.plan.boundaries[self.stage - 1]} (a connection around the cut); choose "
                    "split points that every value crosses through the boundary module's arguments"
                )

    # -- checkpoints (parallel/shards.py) and the full state dict -------------------------------
    def _writes(self, p: nn.Parameter) -> bool:
        """Of the stages sharing a tied parameter, the first writes it."""
        return self.stage == min(self.plan.owners[id(p)])

    def local_shards(self) -> list[LocalShard]:
        out = []
        for name, p in self._stage_params:
            shard = LocalShard.replicated(name, p, self.dp_comm.rank, self.dp_comm.size)
            if not self._writes(p):
                shard = LocalShard(name, p, tuple(p.shape), 0, (0, 0))
            out.append(shard)
        return checkpoint_shards(self.module, out)  # a tensor_parallel model's: TP-qualified names

    def local_buffers(self) -> list[LocalShard]:
        buffers = common.persistent_buffers(self.module)
        shards = [
            LocalShard.from_replica0(n, b, self.dp_comm.rank)
            for n, b in buffers.items()
            if self.plan.buffer_owner.get(n) == self.stage
        ]
        return checkpoint_shards(self.module, shards)

    def after_load(self) -> None:
        pass

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The plain model's state dict, gathered from every stage (see state_dict.py)."""
        mine: dict[str, torch.Tensor] = {}
        if self.replica == 0:
            for name, p in self._stage_params:
                if self._writes(p):
                    mine[name] = p.detach().cpu().clone()
            for name, b in common.persistent_buffers(self.module).items():
                if self.plan.buffer_owner.get(name) == self.stage:
                    mine[name] = b.detach().cpu().clone()
        gathered: list[Any] = [None] * self.comm.size
        # Over this pipeline's group (a tensor_parallel model's: one TP coordinate); the control
        # group where that is the world (a CPU group under NCCL).
        dist.all_gather_object(
            gathered, mine, group=self._control if self.comm.group is None else self.comm.group
        )
        if rank0_only and self.comm.rank != 0:
            return {}
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        out: dict[str, torch.Tensor] = {}
        for key, canonical in self._canonical_names().items():
            out[key] = merged[canonical]
        return out

    def _canonical_names(self) -> dict[str, str]:
        """Every state-dict key of the plain model -> the name its tensor is saved under."""
        keys: dict[str, int] = {}
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            pre = f"{prefix}." if prefix else ""
            for name, t in [*sub._parameters.items(), *sub._buffers.items()]:
                if t is None or (name in sub._buffers and name in sub._non_persistent_buffers_set):
                    continue
                keys[pre + name] = id(t)
        # A tensor registered under several keys (a tied weight; a placeholder of another stage's
        # shares its registrations) is saved under the first, as named_parameters() names it.
        first: dict[int, str] = {}
        for key, tid in keys.items():
            first.setdefault(tid, key)
        return {key: first[tid] for key, tid in keys.items()}


def pipeline(
    model: nn.Module,
    *,
    stages: int,
    microbatches: int = 4,
    schedule: str = "1f1b",
    split: Sequence[str] | None = None,
    loss_fn: LossFn | None = None,
    collective: str = "auto",
    mixed_precision: str | None = None,
    broadcast_buffers: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Pipeline:
    """Cut `model` into `stages` stages over the default process group, or `group` (see the module
    docstring; its ranks are numbered replica * stages + stage).

    split: the P-1 module names where stages 1..P-1 begin (None: balanced among the model's blocks).
        Each must be called with tensors, tuples/lists/dicts of them and constants only (see
        boundary.py); the first step checks the calls, an automatic split's included, and raises
        on every stage naming the argument that cannot cross.
    microbatches: per replica per step; the replica's batch must split into that many equal parts.
        The idle share of a step (bubble) is (P-1)/(M+P-1).
    schedule: "gpipe" (all forwards, then all backwards) or "1f1b" (at most P micro-batches'
        activations alive at once).
    loss_fn(output, targets) -> the mean loss of a micro-batch; default: the output's .loss, else
        cross-entropy of the logits.
    broadcast_buffers: before each step() copy every stage's buffers (BatchNorm's running
        statistics, ...) from replica 0 to the other replicas of that stage, as torch's DDP does
        over its group; nothing to do without replicas. Checkpoints hold replica 0's buffers.
    group: the ranks this pipeline spans (default: the world). A tensor_parallel model's pipeline
        spans the ranks of its TP coordinate: `group=mesh(...).dp_pp` (TP inside each stage); every
        TP coordinate runs its own pipeline, all created at the same point.
    """
    if not dist.is_initialized():
        raise RuntimeError("pipeline() needs torch.distributed.init_process_group() to be called first")
    comm = Comm(collective, group)
    world = comm.size
    if not isinstance(stages, int) or stages < 1 or world % stages:
        raise ValueError(
            f"pipeline: stages={stages!r} must be a positive divisor of the world size {world}"
            f"{' (of group=)' if group is not None else ''}; "
            f"use a world size of k * stages"
        )
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"pipeline: microbatches must be an integer >= 1, got {microbatches!r}")
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"pipeline: schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    if isinstance(model, common.Wrapper):
        raise ValueError(f"pipeline: the model is already wrapped ({type(model).__name__})")
    check_wrappable(model, "pipeline", comm)  # a tensor_parallel model: group= its TP coordinate's
    boundaries = list(split) if split is not None else (auto_split(model, stages) if stages > 1 else [])
    if len(boundaries) != stages - 1:
        raise ValueError(
            f"pipeline: split names {len(boundaries)} boundaries; {stages} stages need {stages - 1}"
        )
    return Pipeline(
        model,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        boundaries=boundaries,
        loss_fn=loss_fn or default_loss,
        collective=collective,
        mixed_precision=mixed_precision,
        broadcast_buffers=broadcast_buffers,
        comm=comm,
    )
