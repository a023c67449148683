"""Measure alpha, beta, gamma and the per-message overhead on the running group, once per group.

Every rank times chains of ring exchanges (send to rank+1, receive from rank-1) of 8 B, 64 KiB and
1 MiB, chains of 8-byte exchanges with every other rank at once, and local reductions of each dtype.
Exchanges are medians over chains of dependent steps (see _step_seconds); alpha is the 8-byte step,
beta the slope through the two larger ones, the overhead what each of the n-2 further peers of an
all-peers step adds. Reductions keep the fastest of a few repetitions. The ranks then average their
numbers with the ring all-reduce, so every rank holds the same bits and picks the same algorithms.
It costs ~250 ms here with 4 ranks on 2 cores (~600 ms with 8), once, inside the collective that
triggered it, in the group's call order, so it is itself a well-ordered collective.

How far to trust it: on the 2-vCPU VM of bench/results, 4 ranks, it does not come out the same
twice. Eight calibrations in a row in one process measured alpha 0.28-1.06 ms and overhead
0.14-0.56 ms. Small messages always went to rd. At 2-8 MiB, though, direct against hd hinges on
overhead < alpha / 2, and four of the eight chose hd at 4 MiB. The benchmark, timing both, had
direct faster at 4 MiB in 8 of 9 runs. Auto took direct in 8 of those 9 runs; in the ninth it
took rd and reached 0.79 of native instead of ~1.0. Two changes did not steady the choice:
15 chains per probe instead of 7 (~430 ms; direct in 13 of 18), and racing the four all-reduce
algorithms at 1 MiB for ~130 ms, whose timings scattered as widely. So auto does not follow the
model blindly: it times the model's close candidates on the caller's own calls (tuning.py). Where
the choice matters, pin it with DTJOB_COLLECTIVE_ALGO.
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

# Probes, as (bytes, with every other rank at once): alpha from 8-byte exchanges, beta through the
# 64 KiB and 1 MiB ones, the overhead from 8 bytes with everybody. Each is timed over chains of 6
# dependent steps, median of 7 samples: 4 x 8 x 6 steps with the warm-up, ~200-300 ms on 4 ranks here.
_MID, _BIG = 64 << 10, 1 << 20
_STEPS = ((8, False), (8, True), (_MID, False), (_BIG, False))
_CHAIN = 6
_CHAINED_REPS = 7
_REDUCE_BYTES = 1 << 20
_REDUCE_REPS = 4
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _step_seconds(comm: Comm) -> dict[tuple[int, bool], float]:
    """Seconds per dependent step for each probe in _STEPS: (bytes, with every other rank at once).

    Each sample times a chain of steps back to back: a step that must wait for the previous one
    also waits for descheduled peers, which is what dependent steps cost when ranks outnumber cores
    (several times a lone exchange here). The probes alternate and the medians are kept, so a burst
    of load shifts all of them alike: the choices depend on their ratios, which the minima of
    separate runs scattered by a factor of 5.
    """
    n, r = comm.size, comm.rank
    probes = {}
    for nbytes, every_peer in _STEPS:
        send = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        offsets = range(1, n) if every_peer else range(1, 2)
        recvs = [(torch.empty_like(send), (r - i) % n) for i in offsets]
        probes[nbytes, every_peer] = ([(send, (r + i) % n) for i in offsets], recvs)
    samples: dict[tuple[int, bool], list[float]] = {key: [] for key in probes}
    for round_ in range(_CHAINED_REPS + 1):  # round 0 warms up
        for key, (sends, recvs) in probes.items():
            start = time.perf_counter()
            for _ in range(_CHAIN):
                send_works, recv_works = comm.post(sends=sends, recvs=recvs)
                wait_all(recv_works)
                wait_all(send_works)
            if round_ > 0:
                samples[key].append((time.perf_counter() - start) / _CHAIN)
    return {key: statistics.median(values) for key, values in samples.items()}


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
    steps = _step_seconds(comm)
    alpha = steps[8, False]
    beta = max((steps[_BIG, False] - steps[_MID, False]) / (_BIG - _MID), 1e-12)
    # What each of the n-2 further message pairs of a direct step adds to a plain exchange.
    overhead = max((steps[8, True] - alpha) / (n - 2), 0.0) if (n := comm.size) > 2 else 0.0
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
