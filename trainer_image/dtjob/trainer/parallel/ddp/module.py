"""`data_parallel(model)`: every rank holds the whole model; gradients are averaged bucket by bucket
while backward runs, as torch's DistributedDataParallel does.

    model = data_parallel(model)                      # after init_process_group(), on its device
    optimizer = torch.optim.AdamW(model.parameters())  # any optimizer, any parameter groups
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()                               # averaged gradients when it returns
        optimizer.step(); optimizer.zero_grad()

Each parameter's `.grad` is a view into its bucket's flat buffer (torch's gradient_as_bucket_view),
so autograd accumulates straight into it. A post-accumulate-grad hook counts arrivals; when a
bucket's last gradient lands, its all-reduce starts asynchronously while backward goes on. Buckets
are launched strictly in index order, so every rank issues the same sequence of collectives, and a
callback queued on the autograd engine waits for them before `backward()` returns.

Accumulation: inside `with model.no_sync():` forward and backward only accumulate locally; the
next backward outside it reduces the sum. Parameters no rank produced a gradient for (in this
backward nor an earlier no_sync one) keep `grad = None`, so the optimizer skips them as it would in
one process (AdamW neither decays them nor moves their moments); one used on some ranks only is
averaged over all ranks, zeros from the rest, as DDP does. Like torch DDP's
find_unused_parameters=True but automatic, and cheaper: one "has a gradient" flag per parameter
rides along in the last bucket (no extra collective, one element of the gradients' dtype each),
and it is read on the host (a device sync) only where this rank lacked a gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dtjob.trainer.parallel import common, syncbn
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.ddp.buckets import Bucket, MiB, assign_buckets, make_bucket
from dtjob.trainer.parallel.shards import LocalShard
from dtjob.trainer.parallel.tp.module import (
    check_wrappable,
    checkpoint_shards,
    mark_bucket_grads,
)

_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_INSTEAD_SHARDING = (
    "every rank holds the whole model, unsharded; to shard parameters use fully_shard(model, zero_stage=3)"
)


class DataParallel(common.GradientSync, common.Wrapper):
    """The module `data_parallel` returns; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        *,
        bucket_mb: float,
        first_bucket_mb: float,
        grad_compression: str,
        broadcast_buffers: bool,
        mixed_precision: str | None,
    ) -> None:
        super().__init__()
        if grad_compression not in ("none", *_WIRE_DTYPES):
            raise ValueError(
                f"data_parallel: grad_compression must be none, bf16 or fp16, got {grad_compression!r}"
            )
        self.module = module
        self.comm = comm
        self.grad_compression = grad_compression
        self.mixed_precision = mixed_precision
        self._named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        common.broadcast_from_rank0([*module.parameters(), *module.buffers()], comm)
        self._buffer_broadcast = common.BufferBroadcast(module, comm, broadcast_buffers)
        syncbn.bind_sync_batchnorms(module, comm, "data_parallel")
        self._device = next(iter(self._named.values())).device if self._named else torch.device("cpu")

        reverse = list(reversed(list(self._named.values())))
        groups = assign_buckets(reverse, int(first_bucket_mb * MiB), int(bucket_mb * MiB))
        last = len(groups) - 1
        self.buckets = [make_bucket(i, g, len(self._named) if i == last else 0) for i, g in enumerate(groups)]
        self._where: dict[int, tuple[Bucket, int]] = {}
        self._flag_index = {id(p): i for i, p in enumerate(self._named.values())}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, i)
                p.register_post_accumulate_grad_hook(common.weak_hook(self, "_on_grad_ready"))
        self._sync = True  # the no_sync() context
        self._sync_this_backward = True  # what the last forward saw
        self._prepared = False  # a forward ran whose backward has not finished
        self._finish_queued = False
        self._next_launch = 0
        # How many bucket all-reduces started inside backward (overlapped) vs after it, last backward.
        self.launched_in_backward = 0
        self.launched_after_backward = 0
        self._in_finish = False
        self._all_have_grads = True  # every parameter had a gradient here when the flags were sent

    # -- the module interface -------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        # Like torch's DDP: rank 0's buffers (e.g. BatchNorm statistics) win (common.BufferBroadcast).
        self._buffer_broadcast.before_forward(grad and self._sync)
        if grad:
            self._prepare_backward()
        with common.autocast(self.mixed_precision, self._device):
            return self.module(*args, **kwargs)

    @property
    def broadcast_buffers(self) -> bool:
        """Whether rank 0's buffers are broadcast before forwards (settable, as on torch's DDP)."""
        return self._buffer_broadcast.enabled

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._buffer_broadcast.enabled = bool(value)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the parameters (every rank holds the same gradients)."""
        return torch.nn.utils.clip_grad_norm_(list(self._named.values()), max_norm, norm_type)

    # -- the rest of torch's DDP / FSDP2 surface (issue #40, README "The torch surface") --------
    def register_comm_hook(self, state: object, hook: Any) -> None:
        common.not_supported("data_parallel", "register_comm_hook", common.INSTEAD_COMM_HOOK)

    def join(self, *args: Any, **kwargs: Any) -> Any:
        common.not_supported("data_parallel", "join", common.INSTEAD_JOIN)

    def set_reshard_after_forward(self, *args: Any, **kwargs: Any) -> None:
        common.not_supported("data_parallel", "set_reshard_after_forward", _INSTEAD_SHARDING)

    def unshard(self, *args: Any, **kwargs: Any) -> Any:
        common.not_supported("data_parallel", "unshard", _INSTEAD_SHARDING)

    def reshard(self) -> None:
        common.not_supported("data_parallel", "reshard", _INSTEAD_SHARDING)

    # -- checkpoints (parallel/shards.py) -------------------------------------------------------
    def local_shards(self) -> list[LocalShard]:
        shards = [LocalShard.replicated(n, p, self.comm.rank, self.comm.size) for n, p in self._named.items()]
        return checkpoint_shards(self.module, shards)  # a tensor_parallel model's: TP-qualified names

    def local_buffers(self) -> list[LocalShard]:
        buffers = common.persistent_buffers(self.module)
        shards = [LocalShard.from_replica0(n, b, self.comm.rank) for n, b in buffers.items()]
        return checkpoint_shards(self.module, shards)

    def after_load(self) -> None:
        pass

    # -- gradient reduction --------------------------------------------------------------------
    def _prepare_backward(self) -> None:
        self._sync_this_backward = self._sync
        self._prepared = True
        self._finish_queued = False
        self._next_launch = 0
        self.launched_in_backward = self.launched_after_backward = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.ready = bucket.launched = False
            bucket.handle = bucket.wire = None

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._prepared:
            raise RuntimeError(
                "data_parallel: a gradient arrived in a backward pass whose forward did not go through "
                "the wrapped model (call the module data_parallel returned, not its .module), or "
                "backward ran twice after one forward; use no_sync() to accumulate over several passes"
            )
        bucket, i = self._where[id(p)]
        view = bucket.grad_views[i]
        if p.grad is not view:
            # Autograd made a new gradient (the first since zero_grad(set_to_none=True)), or
            # accumulated out of place: fold it into the bucket and point .grad back at the view.
            assert p.grad is not None
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        if not self._sync_this_backward:
            return
        if not self._finish_queued:
            common.queue_after_backward(self._finish_reduction)
            self._finish_queued = True
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready = True
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        for p, view in zip(bucket.params, bucket.grad_views, strict=True):
            if p.grad is None:  # no gradient on this rank since zero_grad: contribute zeros
                view.zero_()
        if bucket.flags is not None:
            has = [p.grad is not None for p in self._named.values()]
            self._all_have_grads = all(has)
            if self._all_have_grads:  # the usual case: a device-side fill, no copy from the host
                bucket.flags.fill_(1.0)
            else:
                bucket.flags.copy_(torch.tensor(has, dtype=bucket.flags.dtype))
        wire_dtype = _WIRE_DTYPES.get(self.grad_compression)
        if wire_dtype is None:
            bucket.handle = self.comm.all_reduce_sum(bucket.buffer, async_op=True)
        else:
            # Pre-divided by the world size so that fp16 cannot overflow in the sum.
            bucket.wire = (bucket.buffer / self.comm.size).to(wire_dtype)
            bucket.handle = self.comm.all_reduce_sum(bucket.wire, async_op=True)
        bucket.launched = True
        if self._in_finish:
            self.launched_after_backward += 1
        else:
            self.launched_in_backward += 1

    def _finish_reduction(self) -> None:
        # Parameters that took no part in this backward never fired their hook: send them anyway
        # (their gradient is what accumulated so far, or zeros), in bucket order.
        self._in_finish = True
        for bucket in self.buckets[self._next_launch :]:
            bucket.ready = True
        self._launch_ready_buckets()
        self._in_finish = False
        for bucket in self.buckets:
            assert bucket.handle is not None
            bucket.handle.wait()
            if bucket.wire is not None:
                bucket.buffer.copy_(bucket.wire)
            else:
                bucket.buffer.div_(self.comm.size)
        # Reading the flags waits for the device: only needed when this rank lacked a gradient.
        used = None
        if not self._all_have_grads:
            flags = self.buckets[-1].flags
            assert flags is not None
            used = (flags > 0).tolist()
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.grad_views, strict=True):
                p.grad = view if used is None or used[self._flag_index[id(p)]] else None
        self._prepared = False


def data_parallel(
    model: nn.Module,
    *,
    collective: str = "auto",
    bucket_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    grad_compression: str = "none",
    broadcast_buffers: bool = True,
    mixed_precision: str | None = None,
    group: Any = None,
) -> DataParallel:
    """Train `model` data-parallel over `group` (default: the whole default process group).

    collective: "auto", "ring", "hd", "direct" (dtjob's collectives) or "native" (torch's).
    bucket_mb / first_bucket_mb: gradient bucket caps in MiB (torch's DDP defaults).
    grad_compression: "bf16" or "fp16" halves the bytes on the wire; "none" sends the gradients'
        own dtype.
    broadcast_buffers: copy rank 0's buffers (BatchNorm's running statistics, ...) to every rank
        before a forward, as torch's DDP: before the first, and before one that follows a training
        forward (see common.BufferBroadcast). Checkpoints hold rank 0's buffers either way.
    Unused parameters need no flag: those no rank got a gradient for keep `.grad = None` (see the
    module docstring).
    mixed_precision: None, "bf16" or "fp16": the forward runs under autocast; weights, gradients
        and their reduction keep the parameters' dtype.
    Every rank passes an identically constructed model; rank 0's parameters are broadcast.
    """
    if not torch.distributed.is_initialized():
        raise RuntimeError("data_parallel() needs torch.distributed.init_process_group() to be called first")
    if isinstance(model, common.Wrapper):
        raise ValueError(f"data_parallel: the model is already wrapped ({type(model).__name__})")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("data_parallel: the model has no parameter that requires a gradient")
    comm = Comm(collective, group)
    check_wrappable(model, "data_parallel", comm)
    wrapped = DataParallel(
        model,
        comm,
        bucket_mb=bucket_mb,
        first_bucket_mb=first_bucket_mb,
        grad_compression=grad_compression,
        broadcast_buffers=broadcast_buffers,
        mixed_precision=mixed_precision,
    )
    views = ((p, v) for b in wrapped.buckets for p, v in zip(b.params, b.grad_views, strict=True))
    mark_bucket_grads(model, views)  # a tensor_parallel model's shards, for clip_grad_norm_
    return wrapped
