"""What each rank runs for tests/trainer/test_fsdp_offload.py (ZeRO-Offload, issue #44): a small
vision transformer no other test uses, trained with AdamW (weight decay) and gradient clipping by
fully_shard at ZeRO-1/2/3, with and without offload="optimizer", in real gloo groups; and the
same loop in one process on the global batch (`train_reference`).

"Device" bytes on a CPU-only machine: the device and the host are the same memory here, so the
figures count, once per storage, what the wrapper and the optimizer hold (gathered units, shards,
gradients, flags, buffers, optimizer state), and a storage counts as device memory unless the
offloading side holds it: the wrapper's `host_tensors()` (host shards and their gradients) and,
with offload, the optimizer's state. Without offload nothing is host-held (the optimizer state
sits beside the parameters, as on the GPU). So the figures show where each byte would live, not
what a GPU allocator reports; activations and the collectives' scratch (dtjob's ring caches one
buffer the size of a unit's shard) are not counted.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from dtjob.trainer.parallel import full_state_dict, fully_shard
from dtjob.trainer.parallel.common import NotSupported
from dtjob.trainer.parallel.memory import PeakBytes, storage_bytes
from dtjob.trainer.parallel.shards import local_tensor
from dtjob.trainer.train_state import TrainState
from tests.trainer import _parallel_harness as harness

IMAGE, PATCH, CHANNELS, WIDTH, HEADS, DEPTH, CLASSES = 8, 4, 3, 24, 2, 3, 5
GLOBAL_BATCH = 6  # splits over 2 and 3 ranks
STEPS = 10
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.1, 1.0


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias: a key bias gets a gradient of exactly 0 in exact arithmetic (softmax ignores a
        # shift shared by all keys), so its rounding noise, which AdamW scales up to steps of lr,
        # differs with the summation order (0.9% apart from one process after 10 steps).
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyViT(nn.Module):
    """Patches -> [cls] + tokens + positions -> blocks -> head on cls, scaled by a 0-dim
    temperature. cls (1, 1, W) has one row: one rank owns it, the others none."""

    def __init__(self) -> None:
        super().__init__()
        tokens = (IMAGE // PATCH) ** 2
        self.patch = nn.Conv2d(CHANNELS, WIDTH, PATCH, stride=PATCH)
        self.cls = nn.Parameter(torch.randn(1, 1, WIDTH) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0])) * self.temperature


def shard(model: nn.Module, stage: int, offload: str | None, precision: str | None = None) -> Any:
    # The ring: "auto" picks an algorithm by timed trials, and at world 3 another algorithm sums
    # in another order (6e-8 apart at step 2), so two runs would not be identical.
    return fully_shard(model, zero_stage=stage, offload=offload, collective="ring", mixed_precision=precision)


def build() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT()


def global_batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    images = torch.randn(GLOBAL_BATCH, CHANNELS, IMAGE, IMAGE, generator=g)
    return images, torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    accum: int,
    rank: int,
    world: int,
    on_backward: Any = None,
    scaler: ShardedGradScaler | None = None,
) -> list[float]:
    """The user's loop; rank takes its equal share of every global batch. Returns this rank's
    loss per step (the mean over ranks is the global batch's). scaler: fp16's loss scaling."""
    losses = []
    per = GLOBAL_BATCH // world
    for step in steps:
        total = 0.0
        for micro in range(accum):
            images, labels = global_batch(step, micro)
            mine = slice(rank * per, (rank + 1) * per)
            loss = F.cross_entropy(model(images[mine]), labels[mine]) / accum
            (loss if scaler is None else scaler.scale(loss)).backward()
            total += float(loss.detach())
        if on_backward is not None:
            on_backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def train_reference(accum: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build()
    losses = train(model, adamw(model), range(STEPS), accum, 0, 1)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- memory ----------------------------------------------------------------------------------------


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def split_bytes(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of every storage the wrapper and the optimizer hold, counted once: those on the
    host side of offload, and the rest ("device")."""
    held: list[torch.Tensor] = [
        model._grad_flags.flags,
        *model.module.buffers(),
        *optimizer_tensors(optimizer),
    ]
    for unit in model.units:
        held += [unit.full, *([unit.shard] if unit.shard is not None else [])]
        held += [p.param for p in unit.pieces]
        held += [p.param.grad for p in unit.pieces if p.param.grad is not None]
    host_side = list(model.host_tensors())
    if model.offload is not None:
        host_side += optimizer_tensors(optimizer)
    host = storage_bytes(host_side)
    every = storage_bytes(held)
    assert host.keys() <= every.keys()
    return {"device": sum(every.values()) - sum(host.values()), "host": sum(host.values())}


# --- cases -----------------------------------------------------------------------------------------


def _check_offloaded(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """Every tensor the optimizer holds (parameters, their gradients, its state) is a view of host
    memory the wrapper keeps, not of the device's parameters."""
    hosts = {u.host.untyped_storage().data_ptr() for u in model.units}
    for group in optimizer.param_groups:
        for p in group["params"]:
            assert local_tensor(p).untyped_storage().data_ptr() in hosts
    for t in optimizer_tensors(optimizer):
        assert t.device.type == "cpu"
    device_side = {u.shard.untyped_storage().data_ptr() for u in model.units if u.shard is not None}
    device_side |= {u.full.untyped_storage().data_ptr() for u in model.units}
    assert not hosts & device_side


def run_training(case: dict[str, Any]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    precision = case.get("precision")
    model = shard(build(), case["stage"], case["offload"], precision)
    optimizer = adamw(model)
    scaler = ShardedGradScaler("cpu") if precision == "fp16" else None
    losses = train(model, optimizer, range(STEPS), case["accum"], rank, world, scaler=scaler)
    if case["offload"]:
        _check_offloaded(model, optimizer)
    return {"losses": losses, "state": full_state_dict(model, rank0_only=False)}


def run_resume(case: dict[str, Any]) -> dict[str, Any]:
    """Train half the steps offloaded at ZeRO-3, checkpoint (TrainState), resume into a fresh
    model wrapped as `case["resume"]` says, train the rest."""
    rank, world = dist.get_rank(), dist.get_world_size()
    half = STEPS // 2
    model = shard(build(), 3, "optimizer")
    optimizer = adamw(model)
    first = train(model, optimizer, range(half), 1, rank, world)
    saved = TrainState(model, optimizer)
    shards = {k: (s.offset, s.local.detach().clone(), s.numel) for k, s in saved.state_shards().items()}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, shards)
    flat: dict[str, torch.Tensor] = {}
    for rank_shards in every:
        for key, (offset, local, numel) in rank_shards.items():
            whole = flat.setdefault(key, torch.zeros(numel, dtype=local.dtype))
            whole[offset : offset + local.numel()] = local
    extra = saved.extra_state()
    del model, optimizer, saved

    stage, offload = case["resume"]
    model = shard(build(), stage, offload)  # build(): other weights than saved
    optimizer = adamw(model)
    TrainState(model, optimizer).load(lambda k, s, n: flat[k][s : s + n].clone(), extra, {})
    rest = train(model, optimizer, range(half, STEPS), 1, rank, world)
    return {"losses": first + rest, "state": full_state_dict(model, rank0_only=False)}


def run_memory(case: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-3's bytes with and without offload: after backward (gradients held) and between steps
    (after zero_grad), in the third step (the optimizer's state exists)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard(build(), 3, case["offload"])
    optimizer = adamw(model)
    after_backward: list[dict[str, int]] = []

    def measure() -> None:
        after_backward.append(split_bytes(model, optimizer))

    train(model, optimizer, range(2), 1, rank, world)
    # The third step's forward and backward: the most bytes allocated at once on this thread
    # (PeakBytes), host gradients included (they are allocated as each reduce-scatter finishes).
    tracker = PeakBytes()

    def stop_and_measure() -> None:
        tracker.__exit__(None, None, None)
        measure()

    tracker.__enter__()
    train(model, optimizer, range(2, 3), 1, rank, world, stop_and_measure)
    peak = tracker.peak
    between = split_bytes(model, optimizer)
    units = model.units
    return {
        "after_backward": after_backward[-1],
        "between": between,
        "shard_bytes": sum(u.shard_len * u.full.element_size() for u in units),
        "largest_unit_bytes": max(u.numel * u.full.element_size() for u in units),
        "params": sum(p.numel() for p in build().parameters()),
        # Padding: each parameter's shard is padded to whole rows, at most world - 1 rows of it.
        "padding_bound": 4 * (world - 1) * sum(p[0].numel() if p.dim() else 1 for p in build().parameters()),
        "owned": sum(p.length for u in units for p in u.pieces),
        "optimizer_bytes": sum(storage_bytes(optimizer_tensors(optimizer)).values()),
        "peak": peak,
        "flag_bytes": model._grad_flags.flags.untyped_storage().nbytes(),
    }


def run_refusals(case: dict[str, Any]) -> dict[str, Any]:
    messages = {}
    for offload, error in (("params", NotSupported), ("cpu", ValueError), (True, ValueError)):
        try:
            fully_shard(build(), zero_stage=3, offload=offload)  # type: ignore[arg-type]
        except error as e:
            messages[str(offload)] = str(e)
    return {"messages": messages}


RUNNERS = {"training": run_training, "resume": run_resume, "memory": run_memory, "refusals": run_refusals}


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    return RUNNERS[case["kind"]](case)


def run_world(world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return harness.run_world(world, cases, run_case=run_case)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def mean_losses(ranks: list[dict[str, Any]]) -> list[float]:
    per_step = zip(*(r["losses"] for r in ranks), strict=True)
    return [math.fsum(step) / len(ranks) for step in per_step]
