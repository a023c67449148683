"""BatchNorm buffers under dtjob's wrappers, in real gloo groups (test_parallel_buffers.py).

The model: conv-BatchNorm-ReLU blocks and a linear head, fed batches whose rows differ in mean and
spread, so every rank's slice gives BatchNorm other statistics and the ranks' running statistics
part unless the wrapper makes them agree. A case is a dict:

    name, strategy ("ddp" | "zero1" | "zero2" | "zero3" | "pipeline": 2 stages, 2 micro-batches),
    steps, sync_bn (True: nn.SyncBatchNorm.convert_sync_batchnorm(model); "world": with the
    whole world as its group), save_to / load_from (a checkpoint directory: TrainState's shards,
    every rank's file), broadcast_buffers (default: not passed), expect_error (the exception's
    message is the result: {"raised": ...}), timing (count the broadcasts of a sequence of
    forwards instead: {"broadcasts": [...]}).

Every rank trains `steps` steps on its slice of global_batch(step), saves, evaluates EVAL_X in
eval mode, and returns per case: its losses, its eval outputs (pipeline: the last stage's), and
its buffers. `reference()` is one process running the unwrapped model with torch DDP's buffer
semantics.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BATCH = 12  # global rows per step: splits evenly over 1, 2, 3 and 4 ranks
LR = 0.1


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


def bn_net() -> nn.Sequential:
    """Two conv-BN-ReLU blocks and a head (pooled, flattened, linear): 4 classes."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4))
    return nn.Sequential(conv_bn(3, 6), conv_bn(6, 6), head)


def global_batch(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose mean and spread grow with their index: each rank's slice has its own statistics."""
    g = torch.Generator().manual_seed(1000 + step)
    ramp = torch.arange(rows, dtype=torch.float32).view(-1, 1, 1, 1) / rows
    x = torch.randn(rows, 3, 5, 5, generator=g) * (0.5 + 2 * ramp) + 3 * ramp
    y = torch.randint(0, 4, (rows,), generator=g)
    return x, y


EVAL_X, EVAL_Y = global_batch(99, 4)


def reference(steps: int, world: int, microbatches: int = 1) -> dict[str, Any]:
    """One process, the unwrapped model: each step averages the loss over `world` slices, each cut
    into `microbatches` forwards (BatchNorm over a micro-batch's rows, its statistics updated by
    each), and keeps the buffers the first slice left, as torch's DDP broadcast_buffers=True keeps
    rank 0's."""
    model = bn_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        before = {n: b.clone() for n, b in model.named_buffers()}
        total = 0.0
        rank0: dict[str, torch.Tensor] = {}
        for r, (xs, ys) in enumerate(zip(x.chunk(world), y.chunk(world), strict=True)):
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(before[n])
            for xm, ym in zip(xs.chunk(microbatches), ys.chunk(microbatches), strict=True):
                loss = F.cross_entropy(model(xm), ym) / (world * microbatches)
                loss.backward()
                total += float(loss.detach())
            if r == 0:
                rank0 = {n: b.clone() for n, b in model.named_buffers()}
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(rank0[n])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        out = model(EVAL_X)
    return {"losses": losses, "eval": out, "buffers": dict(model.named_buffers())}


def reference_global(steps: int, replicas: int = 1, microbatches: int = 1) -> dict[str, Any]:
    """One process, BatchNorm over the rows of all `replicas` at once (what SyncBatchNorm over
    them gives): micro-batch m of a step is every replica's m-th micro-batch together."""
    model = bn_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        parts = [
            (xs.chunk(microbatches), ys.chunk(microbatches))
            for xs, ys in zip(x.chunk(replicas), y.chunk(replicas), strict=True)
        ]
        total = 0.0
        for m in range(microbatches):
            xm = torch.cat([px[m] for px, _ in parts])
            ym = torch.cat([py[m] for _, py in parts])
            loss = F.cross_entropy(model(xm), ym) / microbatches
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        out = model(EVAL_X)
    return {"losses": losses, "eval": out, "buffers": dict(model.named_buffers())}


class _Recorder:
    """The pipeline's loss_fn: cross-entropy, keeping the last stage's outputs."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.outputs.append(output.detach().clone())
        return F.cross_entropy(output, targets)


def _wrap(model: nn.Module, case: dict[str, Any], recorder: _Recorder) -> Any:
    from dtjob.trainer.parallel import data_parallel, fully_shard, pipeline

    strategy = case["strategy"]
    # Only where a case sets it: the default must be torch's (True).
    kwargs = {"broadcast_buffers": case["broadcast_buffers"]} if "broadcast_buffers" in case else {}
    if strategy == "ddp":
        return data_parallel(model, **kwargs)
    if strategy.startswith("zero"):
        return fully_shard(model, zero_stage=int(strategy[-1]), **kwargs)
    return pipeline(model, stages=2, microbatches=2, loss_fn=recorder, **kwargs)


def _evaluate(wrapped: Any, case: dict[str, Any], recorder: _Recorder) -> torch.Tensor | None:
    wrapped.eval()
    try:
        if case["strategy"] != "pipeline":
            with torch.no_grad():
                return wrapped(EVAL_X).detach().clone()  # type: ignore[no-any-return]
        # The pipeline has no forward of its own: an eval-mode step, its gradients dropped.
        recorder.outputs.clear()
        wrapped.step(EVAL_X, EVAL_Y)
        wrapped.zero_grad()
        return torch.cat(recorder.outputs) if recorder.outputs else None
    finally:
        wrapped.train()


def _broadcast_timing(case: dict[str, Any]) -> list[int]:
    """How many forwards had broadcast buffers after each of: a training forward and backward, two
    no_grad forwards, training, training under no_sync, training, a training forward."""
    recorder = _Recorder()
    wrapped = _wrap(bn_net(), case, recorder)
    x, y = global_batch(0, 4)
    counts = []

    def train() -> None:
        F.cross_entropy(wrapped(x), y).backward()
        counts.append(wrapped._buffer_broadcast.broadcasts)

    def no_grad() -> None:
        with torch.no_grad():
            wrapped(x)
        counts.append(wrapped._buffer_broadcast.broadcasts)

    train()
    no_grad()
    no_grad()
    train()
    with wrapped.no_sync():
        train()
    train()
    wrapped(x)
    counts.append(wrapped._buffer_broadcast.broadcasts)
    return counts


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    if case.get("timing"):
        return {"broadcasts": _broadcast_timing(case)}
    from dtjob.trainer.train_state import TrainState
    from tests.trainer._parallel_harness import _load_checkpoint, _shards_to_plain

    model = bn_net()
    if case.get("sync_bn"):
        group = dist.group.WORLD if case["sync_bn"] == "world" else None
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    recorder = _Recorder()
    wrapped = _wrap(model, case, recorder)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR, momentum=0.9)
    state = TrainState(wrapped, optimizer)
    if case.get("load_from"):
        _load_checkpoint(state, case["load_from"])
    replicas = getattr(wrapped, "data_parallel_size", dist.get_world_size())
    replica = getattr(wrapped, "data_parallel_rank", dist.get_rank())
    losses = []
    for step in range(case.get("steps", 0)):
        x, y = global_batch(step)
        rows = BATCH // replicas
        x, y = x[replica * rows : (replica + 1) * rows], y[replica * rows : (replica + 1) * rows]
        if case["strategy"] == "pipeline":
            losses.append(wrapped.step(x, y))
        else:
            loss = F.cross_entropy(wrapped(x), y)
            loss.backward()
            losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    if case.get("save_to"):
        directory = case["save_to"]
        os.makedirs(directory, exist_ok=True)
        saved = {"shards": _shards_to_plain(state), "extra": state.extra_state()}
        torch.save(saved, os.path.join(directory, f"rank{dist.get_rank()}.pt"))
        dist.barrier()
    from dtjob.trainer.parallel import full_state_dict

    full = full_state_dict(wrapped, rank0_only=False)
    out = _evaluate(wrapped, case, recorder)
    buffers = {n: b.detach().clone() for n, b in wrapped.module.named_buffers()}
    return {"losses": losses, "eval": out, "buffers": buffers, "full": full}


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank (the run_case of _parallel_harness.World). A case with expect_error
    returns the exception, which every rank raises alike, so the group stays in step."""
    try:
        return _run_case(case)
    except Exception as e:
        if not case.get("expect_error"):
            raise
        return {"raised": f"{type(e).__name__}: {e}"}


def check(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`results` of a world, once no case failed on any rank (else its traceback)."""
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            assert "error" not in result, f"rank {rank}, case {name}:\n{result['error']}"
    return results
