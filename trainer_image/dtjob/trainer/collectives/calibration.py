"""Measure alpha, beta and gamma on the running group, once per group, at its first `auto` call.

Every rank times a ring exchange (send to rank+1, receive from rank-1) of a tiny and of a 1 MiB
message, and local reductions of each dtype; the ranks then average their measurements with the
ring all-reduce, so every rank holds the same bits and picks the same algorithms. It costs a few
tens of milliseconds once. The calibration runs inside the collective that triggered it, in the
group's call order, so it is itself a well-ordered collective.
"""

from __future__ import annotations

import statistics
import time

import torch

from dtjob.trainer.collectives import ring
from dtjob.trainer.collectives.comm import Comm, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction
from dtjob.trainer.collectives.selection import DEFAULT_COSTS, CostModel
from dtjob.trainer.collectives.work import GroupRunner

_SMALL_REPS = 15  # tiny exchanges: median of 15 after 3 warm-ups, ~1-3 ms in all
_LARGE_BYTES = 1 << 20  # 1 MiB: long enough that alpha is < 10% of it on loopback
_LARGE_REPS = 5
_REDUCE_BYTES = 1 << 20
_REDUCE_REPS = 5
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _exchange_seconds(comm: Comm, send: torch.Tensor, recv: torch.Tensor, reps: int) -> float:
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    times = []
    for i in range(reps + 3):
        start = time.perf_counter()
        sends, recvs = comm.post(sends=[(send, nxt)], recvs=[(recv, prv)])
        wait_all(recvs)
        wait_all(sends)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _reduce_seconds_per_byte(dtype: torch.dtype) -> float:
    count = _REDUCE_BYTES // torch.empty(0, dtype=dtype).element_size()
    acc = torch.ones(count, dtype=dtype)
    incoming = torch.ones(count, dtype=dtype)
    times = []
    for _ in range(_REDUCE_REPS):
        start = time.perf_counter()
        torch.add(acc, incoming, out=acc)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / _REDUCE_BYTES


def measure(comm: Comm) -> CostModel:
    """Run the calibration collectively on `comm`'s group; identical result on every rank."""
    if comm.size == 1:
        return DEFAULT_COSTS
    tiny = torch.zeros(1, dtype=torch.float32)
    alpha = _exchange_seconds(comm, tiny, torch.empty_like(tiny), _SMALL_REPS)
    big = torch.zeros(_LARGE_BYTES // 4, dtype=torch.float32)
    large = _exchange_seconds(comm, big, torch.empty_like(big), _LARGE_REPS)
    beta = max(large - alpha, 1e-9) / _LARGE_BYTES
    gammas = [_reduce_seconds_per_byte(d) for d in _DTYPES]
    local = torch.tensor([alpha, beta, *gammas], dtype=torch.float64)
    ring.all_reduce(comm, local, Reduction(torch.distributed.ReduceOp.AVG, torch.float64))
    values = local.tolist()
    return CostModel(
        alpha=values[0],
        beta=values[1],
        gamma={str(d).removeprefix("torch."): g for d, g in zip(_DTYPES, values[2:], strict=True)},
    )


def cost_model(runner: GroupRunner, comm: Comm) -> CostModel:
    """The group's cached cost model, measured on first use (inside a collective call)."""
    cached = runner.cache.get("cost_model")
    if isinstance(cached, CostModel):
        return cached
    model = measure(comm)
    runner.cache["cost_model"] = model
    return model
