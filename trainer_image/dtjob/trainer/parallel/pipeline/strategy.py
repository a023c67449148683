"""Pipeline strategy: one stage of the model per rank, micro-batches flowing through p2p messages.

Layout for world size W = D * P: rank = replica * P + stage. The P ranks of a replica form a
pipeline (activations forward, their gradients backward, as point-to-point messages on the default group);
the D ranks holding the same stage form a data-parallel group that averages that stage's
gradients with dtjob's collectives. All ranks of a replica read the same slice of the batch
(data_parallel_rank = replica): stage 0 needs the inputs, the last stage the targets.

Sends are asynchronous and receives block in schedule order; because every schedule here only
waits on work that its neighbour's schedule has already issued, no order of arrival deadlocks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtjob.trainer.parallel import common
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.config import ParallelConfig
from dtjob.trainer.parallel.pipeline.schedule import schedule_actions, split_stages
from dtjob.trainer.parallel.state import FetchRange, FlatShard

# p2p tags (gloo matches on (peer, tag)); dtjob's collectives use tags >= 2**30.
_TAG_HEADER, _TAG_ACTIVATION, _TAG_GRAD = 11, 12, 13
_HEADER_LEN = 8  # dtype code, ndim, then up to 6 dims
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]


def _new_group(ranks: list[int]) -> dist.ProcessGroup | None:
    """A process group over `ranks` (collective: every rank calls it for every group)."""
    group = dist.new_group(ranks)
    return group if isinstance(group, dist.ProcessGroup) else None


class Stage(nn.Module):
    """A contiguous run of the model's blocks."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return x


class ActivationMeter:
    """Counts the bytes autograd saves for backward (parameters excluded) and their peak.

    Saved tensors are wrapped on the way in; the wrapper's lifetime is the saved tensor's, so a
    finalizer knows when autograd lets go (after that micro-batch's backward).
    """

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


class PipelineStrategy:
    def __init__(
        self,
        model: nn.Module,
        config: ParallelConfig,
        optimizer_factory: common.OptimizerFactory,
        loss_fn: common.LossFn,
    ) -> None:
        self.config = config
        self.loss_fn = loss_fn
        world, rank = dist.get_world_size(), dist.get_rank()
        P = config.pipeline_stages
        if world % P:
            raise ValueError(
                f"world size {world} is not a multiple of ParallelConfig.pipeline_stages={P}; "
                f"use a world size of k * {P} or change pipeline_stages"
            )
        self.stages, self.replicas = P, world // P
        self.stage, self.replica = rank % P, rank // P
        # Every rank must create every group, in the same order.
        pp_groups = [_new_group([d * P + s for s in range(P)]) for d in range(self.replicas)]
        dp_groups = [_new_group([d * P + s for d in range(self.replicas)]) for s in range(P)]
        self.pp_comm = Comm(config.collective, pp_groups[self.replica])
        self.dp_comm = Comm(config.collective, dp_groups[self.stage])
        self.world_comm = Comm(config.collective, None)
        self.prev_rank = rank - 1 if self.stage > 0 else None
        self.next_rank = rank + 1 if self.stage < P - 1 else None

        blocks = common.blocks_in_order(model)
        costs = [sum(p.numel() for p in b.parameters()) for b in blocks]
        spans = split_stages(len(blocks), P, costs)
        shared = common.parameter_shared_across(model, [blocks[a:b] for a, b in spans])
        if shared is not None:
            name, first, second = shared
            raise ValueError(
                f"ParallelConfig(strategy='pipeline', pipeline_stages={P}): parameter {name!r} is used "
                f"on stages {first} and {second} (blocks {spans[first][0]}-{spans[first][1] - 1} and "
                f"{spans[second][0]}-{spans[second][1] - 1} of blocks_in_order()), and each stage would "
                "train its own copy; untie it, choose pipeline_stages so that its uses share a stage, "
                "or use strategy='ddp', or 'fsdp' with zero_stage 1 or 2"
            )
        lo, hi = spans[self.stage]
        self.module = Stage(blocks[lo:hi])
        owned = {id(p) for p in self.module.parameters()}
        self.named_params = {n: p for n, p in model.named_parameters() if id(p) in owned and p.requires_grad}
        owned_buffers = {id(b) for b in self.module.buffers()}
        self.named_buffers = {n: b for n, b in model.named_buffers() if id(b) in owned_buffers}
        common.broadcast_from_rank0([*self.named_params.values(), *self.named_buffers.values()], self.dp_comm)
        if config.activation_checkpointing:
            common.apply_activation_checkpointing(blocks[lo:hi])

        params = list(self.named_params.values())
        self.grad_flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        offset = 0
        for p in params:  # gradients accumulate in place into one flat buffer, all-reduced at once
            p.grad = self.grad_flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        self._grad_views = [p.grad for p in params]
        self.meter = ActivationMeter({p.untyped_storage().data_ptr() for p in params})
        self.optimizer = optimizer_factory(params)
        self.peak_live_microbatches: float | None = None
        self.last_step_busy_s = 0.0
        self.last_step_total_s = 0.0

    # -- TrainStrategy -------------------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        return self.replica

    @property
    def data_parallel_size(self) -> int:
        return self.replicas

    def set_lr(self, lr: float) -> None:
        common.set_lr(self.optimizer, lr)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        start = time.perf_counter()
        self.last_step_busy_s = 0.0
        parts = common.split_batch(inputs, targets, self.config.grad_accum, "grad_accum")
        self.grad_flat.zero_()
        for p, view in zip(self.named_params.values(), self._grad_views, strict=True):
            p.grad = view
        local_loss = 0.0
        self.meter.live = self.meter.peak = 0
        per_microbatch = 0
        for x, y in parts:
            loss, per_microbatch = self._run_schedule(x, y, len(parts))
            local_loss += loss
        if per_microbatch:
            self.peak_live_microbatches = self.meter.peak / per_microbatch
        self.dp_comm.all_reduce_sum(self.grad_flat)
        self.grad_flat.div_(self.replicas)
        if self.config.grad_clip is not None:
            sq = self.grad_flat.double().pow(2).sum().reshape(1)
            self.pp_comm.all_reduce_sum(sq)
            coef = common.clip_coefficient(float(sq.sqrt()), self.config.grad_clip)
            if coef < 1.0:
                self.grad_flat.mul_(coef)
        self.optimizer.step()
        # The loss lives on the last stages: sum theirs over the world, average over replicas.
        total = torch.tensor([local_loss if self.next_rank is None else 0.0], dtype=torch.float64)
        self.world_comm.all_reduce_sum(total)
        self.last_step_total_s = time.perf_counter() - start
        return float(total.item()) / self.replicas

    # -- the schedule --------------------------------------------------------------------------
    def _run_schedule(self, inputs: torch.Tensor, targets: torch.Tensor, parts: int) -> tuple[float, int]:
        """One pass of the schedule over one batch; returns (its loss share, saved bytes per micro-batch)."""
        M = self.config.microbatches
        micro = common.split_batch(inputs, targets, M, "microbatches")
        stage_inputs: dict[int, torch.Tensor] = {}
        stage_outputs: dict[int, torch.Tensor] = {}
        sends: list[Any] = []
        loss_sum = 0.0
        per_microbatch = 0
        out_shape: tuple[tuple[int, ...], torch.dtype] | None = None
        in_header: tuple[tuple[int, ...], torch.dtype] | None = None
        for action in schedule_actions(self.config.schedule, self.stage, self.stages, M):
            m = action.microbatch
            if action.kind == "F":
                if self.prev_rank is None:
                    x = micro[m][0]
                else:
                    if in_header is None:
                        in_header = self._recv_header()
                    x = self._recv(in_header, _TAG_ACTIVATION, self.prev_rank)
                    if x.is_floating_point():
                        x.requires_grad_(True)
                t0 = time.perf_counter()
                before = self.meter.live
                saving = torch.autograd.graph.saved_tensors_hooks(self.meter.pack, self.meter.unpack)
                with saving, common.precision_context(self.config.precision):
                    out = self.module(x)
                    if self.next_rank is None:
                        out = self.loss_fn(out, micro[m][1]) / (M * parts)
                per_microbatch = per_microbatch or self.meter.live - before
                self.last_step_busy_s += time.perf_counter() - t0
                if not isinstance(out, torch.Tensor):
                    raise TypeError("a pipeline stage must output a single tensor")
                if self.next_rank is None:
                    loss_sum += float(out.detach())
                else:
                    if out_shape is None:
                        out_shape = (tuple(out.shape), out.dtype)
                        sends.append(self._send_header(out))
                    sends.append(
                        self.world_comm.send(out.detach(), self.next_rank, _TAG_ACTIVATION, async_op=True)
                    )
                stage_inputs[m], stage_outputs[m] = x, out
            else:
                x, out = stage_inputs.pop(m), stage_outputs.pop(m)
                if self.next_rank is None:
                    grad = None
                else:
                    assert out_shape is not None
                    grad = self._recv(out_shape, _TAG_GRAD, self.next_rank)
                t0 = time.perf_counter()
                torch.autograd.backward(out, grad)
                self.last_step_busy_s += time.perf_counter() - t0
                del out
                if self.prev_rank is not None and x.grad is not None:
                    sends.append(self.world_comm.send(x.grad, self.prev_rank, _TAG_GRAD, async_op=True))
        for work in sends:
            work.wait()
        return loss_sum, per_microbatch

    def _send_header(self, t: torch.Tensor) -> Any:
        if t.dim() > _HEADER_LEN - 2:
            raise ValueError(f"pipeline activations may have at most {_HEADER_LEN - 2} dims, got {t.dim()}")
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
        header[2 : 2 + t.dim()] = torch.tensor(t.shape)
        assert self.next_rank is not None
        return self.world_comm.send(header, self.next_rank, _TAG_HEADER, async_op=True)

    def _recv_header(self) -> tuple[tuple[int, ...], torch.dtype]:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        assert self.prev_rank is not None
        self.world_comm.recv(header, self.prev_rank, _TAG_HEADER)
        ndim = int(header[1])
        return tuple(int(d) for d in header[2 : 2 + ndim]), _DTYPES[int(header[0])]

    def _recv(self, spec: tuple[tuple[int, ...], torch.dtype], tag: int, src: int) -> torch.Tensor:
        t = torch.empty(spec[0], dtype=spec[1])
        self.world_comm.recv(t, src, tag)
        return t

    # -- CheckpointableStrategy ----------------------------------------------------------------
    def state_shards(self) -> Mapping[str, FlatShard]:
        # Stage-local tensors, split between the replicas holding this stage.
        return common.replicated_state_shards(
            self.named_params, self.named_buffers, self.optimizer, self.dp_comm.rank, self.dp_comm.size
        )

    def extra_state(self) -> dict[str, Any]:
        state, params = self.optimizer.state, self.named_params
        extra = common.optimizer_extra_state(params, lambda n: state.get(params[n], {}))
        return {"optim": extra, "pipeline_stages": self.stages}

    def load_state_shards(self, fetch: FetchRange, extra: dict[str, Any]) -> None:
        saved_stages = extra.get("pipeline_stages", self.stages)
        if saved_stages != self.stages:
            raise ValueError(
                f"checkpoint was written with pipeline_stages={saved_stages}; resume with the same value "
                f"(got {self.stages})"
            )
        common.load_replicated_state(self.named_params, self.named_buffers, self.optimizer, fetch, extra)

    # -- introspection for tests and benchmarks ------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        return {
            "params": sum(p.numel() * p.element_size() for p in self.named_params.values()),
            "grads": self.grad_flat.numel() * self.grad_flat.element_size(),
            "optim": sum(
                v.numel() * v.element_size()
                for s in self.optimizer.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            ),
        }
