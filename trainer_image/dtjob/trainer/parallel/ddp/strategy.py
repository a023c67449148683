"""DDP: every rank holds the whole model; gradients are averaged bucket by bucket during backward.

Each parameter's `.grad` is a view into its bucket's flat buffer (torch's gradient_as_bucket_view),
so autograd accumulates straight into the buffer and nothing is copied. A post-accumulate-grad
hook counts arrivals; when a bucket's last gradient lands, its all-reduce starts asynchronously
while backward continues. Buckets are launched strictly in index order so every rank issues the
same sequence of collectives even if hooks fire in a different order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dtjob.trainer.parallel import common
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.config import ParallelConfig
from dtjob.trainer.parallel.ddp.buckets import Bucket, MiB, assign_buckets, make_bucket
from dtjob.trainer.parallel.state import FetchRange, FlatShard

_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class DDPStrategy(common.DataParallel):
    def __init__(
        self,
        model: nn.Module,
        config: ParallelConfig,
        optimizer_factory: common.OptimizerFactory,
        loss_fn: common.LossFn,
        comm: Comm,
    ) -> None:
        super().__init__(model, config, loss_fn, comm)
        self._sync = True
        self.named_params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if config.activation_checkpointing:
            common.apply_activation_checkpointing(common.blocks_in_order(model))

        reverse = list(reversed(list(self.named_params.values())))
        groups = assign_buckets(
            reverse, int(config.ddp_first_bucket_mb * MiB), int(config.ddp_bucket_mb * MiB)
        )
        self.buckets = [make_bucket(i, g) for i, g in enumerate(groups)]
        self._where: dict[nn.Parameter, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._where[p] = (bucket, i)
                p.grad = bucket.grad_views[i]
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._next_launch = 0
        self._in_finish = False
        # How many bucket all-reduces started inside backward (overlapped) vs after it, last step.
        self.launched_in_backward = 0
        self.launched_after_backward = 0
        self._reset_buckets()
        self.optimizer = optimizer_factory(list(self.named_params.values()))

    # -- TrainStrategy (data_parallel_rank/size and set_lr: common.DataParallel) ----------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        micro = common.split_batch(inputs, targets, self.config.grad_accum, "grad_accum")
        self.launched_in_backward = self.launched_after_backward = 0
        for bucket in self.buckets:
            bucket.buffer.zero_()
        if self.named_buffers:  # like torch DDP: rank 0's buffers (e.g. BatchNorm stats) win
            common.broadcast_from_rank0(list(self.named_buffers.values()), self.comm)
        local_loss = 0.0
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                self._reset_buckets()
                with common.precision_context(self.config.precision):
                    loss = self.loss_fn(self.model(x), y) / len(micro)
                loss.backward()
                local_loss += float(loss.detach())
        self._finish_reduction()
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(list(self.named_params.values()), self.config.grad_clip)
        self.optimizer.step()
        return self.comm.all_reduce_mean_scalar(local_loss)

    # -- gradient reduction --------------------------------------------------------------------
    def _reset_buckets(self) -> None:
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.ready = bucket.launched = False
            bucket.handle = bucket.wire = None

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket, i = self._where[p]  # type: ignore[index]
        view = bucket.grad_views[i]
        if p.grad is not view:
            # Autograd replaced the gradient (e.g. someone set .grad = None): fold it back in.
            assert p.grad is not None
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready = True
            if self._sync:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        wire_dtype = _WIRE_DTYPES.get(self.config.grad_compression)
        if wire_dtype is None:
            bucket.handle = self.comm.all_reduce_sum(bucket.buffer, async_op=True)
        else:
            bucket.wire = (bucket.buffer / self.comm.size).to(wire_dtype)
            bucket.handle = self.comm.all_reduce_sum(bucket.wire, async_op=True)
        bucket.launched = True
        if self._in_finish:
            self.launched_after_backward += 1
        else:
            self.launched_in_backward += 1

    def _finish_reduction(self) -> None:
        # Parameters that took no part in this backward never fired their hook: send them anyway
        # (their gradient is what accumulated so far, possibly zero), in bucket order.
        for bucket in self.buckets[self._next_launch :]:
            bucket.ready = True
        self._in_finish = True
        self._launch_ready_buckets()
        self._in_finish = False
        for bucket in self.buckets:
            assert bucket.handle is not None
            bucket.handle.wait()
            if bucket.wire is not None:
                bucket.buffer.copy_(bucket.wire)
            else:
                bucket.buffer.div_(self.comm.size)
        for bucket in self.buckets:
            for p, view in zip(bucket.params, bucket.grad_views, strict=True):
                p.grad = view

    # -- CheckpointableStrategy ----------------------------------------------------------------
    def state_shards(self) -> Mapping[str, FlatShard]:
        return common.replicated_state_shards(
            self.named_params, self.named_buffers, self.optimizer, self.comm.rank, self.comm.size
        )

    def extra_state(self) -> dict[str, Any]:
        state = self.optimizer.state
        params = self.named_params
        return {"optim": common.optimizer_extra_state(params, lambda n: state.get(params[n], {}))}

    def load_state_shards(self, fetch: FetchRange, extra: dict[str, Any]) -> None:
        common.load_replicated_state(self.named_params, self.named_buffers, self.optimizer, fetch, extra)

    # -- introspection for tests and benchmarks ------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds between steps."""
        return {
            "params": sum(p.numel() * p.element_size() for p in common.iter_unique(self.model.parameters())),
            "grads": sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets),
            "optim": sum(
                v.numel() * v.element_size()
                for s in self.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            ),
        }
