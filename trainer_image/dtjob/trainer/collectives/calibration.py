"""Measure alpha, beta, gamma and the per-message overhead on the running group, once per group.

Every rank times ring exchanges (send to rank+1, receive from rank-1) of 8 B, 64 KiB and 1 MiB, one
step of eight 8-byte messages, and local reductions of each dtype. It keeps the fastest of several
repetitions - on a shared machine the slow ones measure other processes, not the link - and fits
t = alpha + beta * bytes through the two large points (alpha is the 8-byte time; the overhead is
what each of the seven further messages added). The ranks then average their numbers with the ring
all-reduce, so every rank holds the same bits and picks the same algorithms. It costs a few tens
of milliseconds, once, inside the collective that triggered it, in the group's call order, so it
is itself a well-ordered collective.
"""

from __future__ import annotations

import time

import torch

from dtjob.trainer.collectives import ring
from dtjob.trainer.collectives.comm import Comm, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction
from dtjob.trainer.collectives.selection import DEFAULT_COSTS, CostModel
from dtjob.trainer.collectives.work import GroupRunner

# (bytes, repetitions): enough repetitions that the fastest is a clean one, ~20-40 ms in all.
_PROBES = ((8, 12), (64 << 10, 6), (1 << 20, 4))
_WARMUP = 2
# Small messages posted in one step to time the per-message overhead: (t(8) - t(1)) / 7.
_BATCH = 8
_REDUCE_BYTES = 1 << 20
_REDUCE_REPS = 4
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _exchange_seconds(comm: Comm, nbytes: int, reps: int, messages: int = 1) -> float:
    """Fastest time of `messages` sends to rank+1 (and receives from rank-1), posted at once."""
    send = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    recvs_into = [torch.empty_like(send) for _ in range(messages)]
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    best = float("inf")
    for i in range(reps + _WARMUP):
        start = time.perf_counter()
        sends, recvs = comm.post(sends=[(send, nxt)] * messages, recvs=[(r, prv) for r in recvs_into])
        wait_all(recvs)
        wait_all(sends)
        if i >= _WARMUP:
            best = min(best, time.perf_counter() - start)
    return best


def _reduce_seconds_per_byte(dtype: torch.dtype) -> float:
    count = _REDUCE_BYTES // torch.empty(0, dtype=dtype).element_size()
    acc = torch.ones(count, dtype=dtype)
    incoming = torch.ones(count, dtype=dtype)
    best = float("inf")
    for _ in range(_REDUCE_REPS):
        start = time.perf_counter()
        torch.add(acc, incoming, out=acc)
        best = min(best, time.perf_counter() - start)
    return best / _REDUCE_BYTES


def measure(comm: Comm) -> CostModel:
    """Run the calibration collectively on `comm`'s group; identical result on every rank."""
    if comm.size == 1:
        return DEFAULT_COSTS
    mid, big = _PROBES[1][0], _PROBES[2][0]
    times = [_exchange_seconds(comm, nbytes, reps) for nbytes, reps in _PROBES]
    alpha = times[0]
    beta = max((times[2] - times[1]) / (big - mid), 1e-12)
    batch = _exchange_seconds(comm, 8, _PROBES[0][1], messages=_BATCH)
    overhead = max((batch - alpha) / (_BATCH - 1), 0.0)
    gammas = [_reduce_seconds_per_byte(d) for d in _DTYPES]
    local = torch.tensor([alpha, beta, overhead, *gammas], dtype=torch.float64)
    ring.all_reduce(comm, local, Reduction(torch.distributed.ReduceOp.AVG, torch.float64))
    values = local.tolist()
    return CostModel(
        alpha=values[0],
        beta=values[1],
        overhead=values[2],
        gamma={str(d).removeprefix("torch."): g for d, g in zip(_DTYPES, values[3:], strict=True)},
    )


def cost_model(runner: GroupRunner, comm: Comm) -> CostModel:
    """The group's cached cost model, measured on first use (inside a collective call)."""
    cached = runner.cache.get("cost_model")
    if isinstance(cached, CostModel):
        return cached
    model = measure(comm)
    runner.cache["cost_model"] = model
    return model
