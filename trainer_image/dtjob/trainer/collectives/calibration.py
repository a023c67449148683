"""Measure alpha, beta, gamma and the per-message overhead on the running group, once per group.

Every rank times ring exchanges (send to rank+1, receive from rank-1) of 8 B, 64 KiB and 1 MiB, one
8-byte exchange with every other rank at once, and local reductions of each dtype. It keeps the
fastest of several repetitions - on a shared machine the slow ones measure other processes, not the
link - and fits t = alpha + beta * bytes through the two large points. alpha and the overhead are
timed over chains of dependent 8-byte steps (alpha: per plain exchange; overhead: what each of the
n-2 further peers of an all-peers step adds). The ranks then average their numbers with the ring
all-reduce, so every rank holds the same bits and picks the same algorithms. It costs 50-150 ms
here (4 ranks on 2 cores), once, inside the collective that triggered it, in the group's call
order, so it is itself a well-ordered collective.
"""

from __future__ import annotations

import time

import torch

from dtjob.trainer.collectives import ring
from dtjob.trainer.collectives.comm import Comm, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction
from dtjob.trainer.collectives.selection import DEFAULT_COSTS, CostModel
from dtjob.trainer.collectives.work import GroupRunner

# (bytes, repetitions) of the two exchanges beta is fitted through: enough repetitions that the
# fastest is a clean one.
_PROBES = ((64 << 10, 6), (1 << 20, 4))
_WARMUP = 2
# alpha and the overhead are timed over chains of 6 dependent 8-byte steps, best of 5.
_CHAIN = 6
_CHAINED_REPS = 5
_REDUCE_BYTES = 1 << 20
_REDUCE_REPS = 4
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _exchange_seconds(comm: Comm, nbytes: int, reps: int, all_peers: bool = False, chain: int = 1) -> float:
    """Fastest time of a send to rank+1 and a receive from rank-1 - or, with `all_peers`, of a send
    to and a receive from every other rank, all posted at once (one step of the direct algorithm).

    With `chain` > 1 each repetition runs that many steps back to back and reports the mean: a step
    that must wait for the previous one also waits for descheduled peers, which is what dependent
    steps cost when ranks outnumber cores (several times a lone exchange here).
    """
    send = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    n, r = comm.size, comm.rank
    offsets = range(1, n) if all_peers else range(1, 2)
    recvs_into = [(torch.empty_like(send), (r - i) % n) for i in offsets]
    best = float("inf")
    for i in range(reps + _WARMUP):
        start = time.perf_counter()
        for _ in range(chain):
            sends, recvs = comm.post(sends=[(send, (r + i) % n) for i in offsets], recvs=recvs_into)
            wait_all(recvs)
            wait_all(sends)
        if i >= _WARMUP:
            best = min(best, (time.perf_counter() - start) / chain)
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
    (mid, _), (big, _) = _PROBES
    mid_seconds, big_seconds = (_exchange_seconds(comm, nbytes, reps) for nbytes, reps in _PROBES)
    beta = max((big_seconds - mid_seconds) / (big - mid), 1e-12)
    alpha = _exchange_seconds(comm, 8, _CHAINED_REPS, chain=_CHAIN)
    # What each of the n-2 further message pairs of a direct step adds to a plain exchange.
    overhead = 0.0
    if comm.size > 2:
        step = _exchange_seconds(comm, 8, _CHAINED_REPS, all_peers=True, chain=_CHAIN)
        overhead = max((step - alpha) / (comm.size - 2), 0.0)
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
