"""Measure alpha, beta, gamma and the per-message overhead on the running group, once per group.

Every rank times chains of ring exchanges (send to rank+1, receive from rank-1) of 8 B, 64 KiB and
1 MiB, chains of 8-byte exchanges with every other rank at once, and local reductions of each dtype.
Exchanges are medians over chains of dependent steps (see _step_seconds); alpha is the 8-byte step,
beta the slope through the two larger ones, the overhead what each of the n-2 further peers of an
all-peers step adds. Reductions keep the fastest of a few repetitions. The ranks then average their
numbers with the ring all-reduce, so every rank holds the same bits and picks the same algorithms.
It costs ~250 ms with 4 ranks sharing 2 cores (~600 ms with 8), once, at the group's first auto
call, after the calls queued before it, so it is itself a well-ordered collective.

How far to trust it: on a 2-vCPU VM with 4 ranks it does not come out the same twice (alpha
0.3-1.1 ms, overhead 0.1-0.6 ms over eight calibrations in a row), and at 2-8 MiB direct against
hd hinges on overhead < alpha / 2. So auto does not follow the model blindly: it times the
model's close candidates on the caller's own calls (tuning.py). Where the choice matters, pin it
with DTJOB_COLLECTIVE_ALGO.

On CUDA the probes and reductions run on the call's device, timed between device
synchronizations (this is the only place besides the trials' agreement where the collectives
wait for the device, once per group).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dtjob.trainer.collectives import ring
from dtjob.trainer.collectives.peers import Peers, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction
from dtjob.trainer.collectives.selection import DEFAULT_COSTS, CostModel
from dtjob.trainer.collectives.work import GroupRunner

# Probes, as (bytes, with every other rank at once): alpha from 8-byte exchanges, beta through the
# 64 KiB and 1 MiB ones, the overhead from 8 bytes with everybody. Each is timed over chains of 6
# dependent steps, median of 7 samples: 4 x 8 x 6 steps with the warm-up.
_MID, _BIG = 64 << 10, 1 << 20
_STEPS = ((8, False), (8, True), (_MID, False), (_BIG, False))
_CHAIN = 6
_CHAINED_REPS = 7
_REDUCE_BYTES = 1 << 20
_REDUCE_REPS = 4
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def _now(device: torch.device) -> float:
    """perf_counter once the device has done everything queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _step_seconds(peers: Peers, device: torch.device) -> dict[tuple[int, bool], float]:
    """Seconds per dependent step for each probe in _STEPS: (bytes, with every other rank at once).

    Each sample times a chain of steps back to back: a step that must wait for the previous one
    also waits for descheduled peers, which is what dependent steps cost when ranks outnumber cores
    (several times a lone exchange here). The probes alternate and the medians are kept, so a burst
    of load shifts all of them alike: the choices depend on their ratios, which the minima of
    separate runs scattered by a factor of 5.
    """
    n, r = peers.size, peers.rank
    probes = {}
    for nbytes, every_peer in _STEPS:
        send = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        offsets = range(1, n) if every_peer else range(1, 2)
        recvs = [(torch.empty_like(send), (r - i) % n) for i in offsets]
        probes[nbytes, every_peer] = ([(send, (r + i) % n) for i in offsets], recvs)
    samples: dict[tuple[int, bool], list[float]] = {key: [] for key in probes}
    for round_ in range(_CHAINED_REPS + 1):  # round 0 warms up
        for key, (sends, recvs) in probes.items():
            start = _now(device)
            for _ in range(_CHAIN):
                send_works, recv_works = peers.post(sends=sends, recvs=recvs)
                wait_all(recv_works)
                wait_all(send_works)
            if round_ > 0:
                samples[key].append((_now(device) - start) / _CHAIN)
    return {key: statistics.median(values) for key, values in samples.items()}


def _reduce_seconds_per_byte(dtype: torch.dtype, device: torch.device) -> float:
    count = _REDUCE_BYTES // torch.empty(0, dtype=dtype).element_size()
    acc = torch.ones(count, dtype=dtype, device=device)
    incoming = torch.ones(count, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(_REDUCE_REPS):
        start = _now(device)
        torch.add(acc, incoming, out=acc)
        best = min(best, _now(device) - start)
    return best / _REDUCE_BYTES


def measure(peers: Peers, device: torch.device) -> CostModel:
    """Run the calibration collectively on `peers`'s group with tensors on `device`; identical
    result on every rank."""
    if peers.size == 1:
        return DEFAULT_COSTS
    steps = _step_seconds(peers, device)
    alpha = steps[8, False]
    beta = max((steps[_BIG, False] - steps[_MID, False]) / (_BIG - _MID), 1e-12)
    # What each of the n-2 further message pairs of a direct step adds to a plain exchange.
    overhead = max((steps[8, True] - alpha) / (n - 2), 0.0) if (n := peers.size) > 2 else 0.0
    gammas = [_reduce_seconds_per_byte(d, device) for d in _DTYPES]
    local = torch.tensor([alpha, beta, overhead, *gammas], dtype=torch.float64, device=device)
    ring.all_reduce(peers, local, Reduction(dist.ReduceOp.AVG, torch.float64))
    values = local.tolist()
    return CostModel(
        alpha=values[0],
        beta=values[1],
        overhead=values[2],
        gamma={str(d).removeprefix("torch."): g for d, g in zip(_DTYPES, values[3:], strict=True)},
    )


def same_everywhere(peers: Peers, value: int, device: torch.device) -> bool:
    """Whether every rank of `peers` passed the same whole number (one small all-reduce)."""
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    ring.all_reduce(peers, both, Reduction(dist.ReduceOp.MAX, torch.int64))
    high, low = both.tolist()
    return bool(high == -low)


def cost_model(runner: GroupRunner, peers: Peers, device: torch.device) -> CostModel:
    """The group's cached cost model for `device`'s type, measured on first use (collectively:
    every rank gets here at the same call)."""
    key = f"cost_model:{device.type}"
    cached = runner.cache.get(key)
    if isinstance(cached, CostModel):
        return cached
    model = measure(peers, device)
    runner.cache[key] = model
    return model
