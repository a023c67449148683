"""What each rank runs in the multi-process collective tests (see collectives_harness.py).

Every scenario is `fn(rank, world_size, arg) -> value`; it compares dtjob's collectives with
torch.distributed's gloo collectives on the same inputs inside the process group, collects
mismatches as strings (so one run reports all of them), and returns digests of results that must
be bitwise identical on every rank for the test to compare across ranks.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, cast

import torch
import torch.distributed as dist

from dtjob.trainer import collectives as C
from dtjob.trainer.collectives.peers import Peers

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
REDUCE_OPS = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN]
LARGE_ODD = 100_003


def lengths(n: int) -> list[int]:
    return [*sorted({0, 1, max(n - 1, 0), n, n + 1}), LARGE_ODD]


# The suite's budget is 4 minutes on a loaded 2-core machine, so the full product is thinned where
# it adds no code path: SUM (and `auto`) run at every length and dtype; AVG/MAX/MIN at length n+1
# and the large odd length (the other lengths only change the chunking, which SUM covers); every
# dtype runs at n+1 and the large odd length, the lengths 1, n-1 and n run in float32, bfloat16 and
# int64 (the chunking does not depend on the dtype), length 0 (which returns before any message) in
# float32 and int64; the large odd length runs every op in float32 and bfloat16, SUM in every dtype.
def covered(n: int, length: int, dtype: torch.dtype, red: Any = dist.ReduceOp.SUM) -> bool:
    if red != dist.ReduceOp.SUM and length not in (n + 1, LARGE_ODD):
        return False
    if length == 0:
        return dtype in (torch.float32, torch.int64)
    if length in (1, n - 1, n) and length != n + 1:
        return dtype in (torch.float32, torch.bfloat16, torch.int64)  # one per width class
    if length == LARGE_ODD:
        return red == dist.ReduceOp.SUM or dtype in (torch.float32, torch.bfloat16)
    return True


def algorithms(op: str, red: Any = dist.ReduceOp.SUM) -> list[str]:
    """Every algorithm of `op` that runs on any group (hier needs pods: hierarchical() tests it)."""
    flat = [a for a in C.ALGORITHMS[op] if a != "hier"]
    return [*flat, "auto"] if red == dist.ReduceOp.SUM else flat


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make_input(seed: int, rank: int, length: int, dtype: torch.dtype, exact: bool) -> torch.Tensor:
    """Small integers when `exact` (every sum of up to 8 of them is exact in every dtype), else randn."""
    gen = torch.Generator().manual_seed(seed * 1_000 + rank)
    if exact or not dtype.is_floating_point:
        return torch.randint(-8, 9, (length,), generator=gen).to(dtype)
    return torch.randn(length, generator=gen).to(dtype)


def _name(op: Any) -> str:
    return str(op).rsplit(".", 1)[-1]


class Checker:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.digests: dict[str, str] = {}
        self.cases = 0

    def fail(self, what: str) -> None:
        if len(self.failures) < 40:
            self.failures.append(what)

    def same(self, key: str, mine: torch.Tensor, ref: torch.Tensor) -> None:
        self.cases += 1
        if mine.is_complex() and ref.is_complex():  # torch.equal has no complex32
            mine, ref = torch.view_as_real(mine), torch.view_as_real(ref)
        if mine.shape != ref.shape or not torch.equal(mine, ref):
            bad = (mine != ref).nonzero()[:3].flatten().tolist() if mine.shape == ref.shape else "shape"
            self.fail(f"{key}: differs from torch at {bad}")

    def close(self, key: str, mine: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
        self.cases += 1
        mine, ref, bound = mine.reshape(-1), ref.reshape(-1), bound.reshape(-1)
        err = (mine.double() - ref.double()).abs()
        if not bool((err <= bound).all()):
            worst = int((err - bound).argmax())
            self.fail(f"{key}: |ours - torch| = {err[worst].item()} > bound {bound[worst].item()} at {worst}")

    def result(self) -> dict[str, Any]:
        return {"failures": self.failures, "digests": self.digests, "cases": self.cases}


def _rounding_bound(
    n: int, dtype: torch.dtype, inputs: list[torch.Tensor], ref: torch.Tensor
) -> torch.Tensor:
    """Two orders of summing n terms differ by at most 2(n-1) eps sum|x|, plus AVG's own rounding."""
    eps = torch.finfo(dtype).eps
    total = torch.stack([x.double().abs() for x in inputs]).sum(0)
    return 2 * (n - 1) * eps * total + 2 * eps * ref.double().abs() + 1e-300


def matrix(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """Every op x dtype x algorithm x length (x reduce op) against torch's gloo collectives.

    `arg`: the dtypes to run (default DTYPES)."""
    # 8 KiB segments: the large odd length is then cut into many unequal segments per chunk, which
    # exercises the pipelining (the default policy only cuts regions of 8 MiB and more).
    os.environ["DTJOB_COLLECTIVE_SEGMENT_BYTES"] = "8192"
    check = Checker()
    for dtype in arg or DTYPES:
        dname = str(dtype).removeprefix("torch.")
        for length in lengths(n):
            # --- all_reduce and reduce_scatter_tensor, exact-valued and random inputs
            for red in REDUCE_OPS:
                integer_avg = red == dist.ReduceOp.AVG and not dtype.is_floating_point
                if integer_avg or not covered(n, length, dtype, red):
                    continue
                sums = red in (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
                random_too = dtype.is_floating_point and sums and length == LARGE_ODD
                kinds = ["exact", "random"] if random_too else ["exact"]
                for kind in kinds:
                    exact = kind == "exact"
                    seed = length * 7 + DTYPES.index(dtype)
                    x = make_input(seed, rank, length, dtype, exact)
                    ref = x.clone()
                    dist.all_reduce(ref, red)
                    everyone = (
                        [make_input(seed, r, length, dtype, exact) for r in range(n)] if not exact else []
                    )
                    for algo in algorithms("allreduce", red):
                        key = f"allreduce/{dname}/{_name(red)}/{length}/{algo}/{kind}"
                        mine = x.clone()
                        C.all_reduce(mine, red, algorithm=algo)
                        check.digests[key] = digest(mine)
                        if exact:
                            check.same(key, mine, ref)
                        else:
                            check.close(key, mine, ref, _rounding_bound(n, dtype, everyone, ref))
                    # reduce_scatter: `length` elements per rank. Its total is a multiple of n, so the
                    # lengths n-1 and n add no new chunking; they run for all_reduce and broadcast.
                    if length not in (0, 1, n + 1, LARGE_ODD):
                        continue
                    xin = make_input(seed + 1, rank, length * n, dtype, exact)
                    ref_out = torch.empty(length, dtype=dtype)
                    dist.reduce_scatter_tensor(ref_out, xin, red)
                    everyone_rs = (
                        [
                            make_input(seed + 1, r, length * n, dtype, exact)[
                                rank * length : (rank + 1) * length
                            ]
                            for r in range(n)
                        ]
                        if not exact
                        else []
                    )
                    for algo in algorithms("reduce_scatter", red):
                        key = f"reduce_scatter/{dname}/{_name(red)}/{length}/{algo}/{kind}"
                        out = torch.full((length,), 99, dtype=dtype)
                        before = xin.clone()
                        C.reduce_scatter_tensor(out, xin, red, algorithm=algo)
                        if not torch.equal(before, xin):
                            check.fail(f"{key}: input was modified")
                        if exact:
                            check.same(key, out, ref_out)
                        else:
                            check.close(key, out, ref_out, _rounding_bound(n, dtype, everyone_rs, ref_out))
            if not covered(n, length, dtype):
                continue
            # --- all_gather_into_tensor (per-rank length, so n-1 and n are skipped as for reduce_scatter)
            inp = make_input(length, rank, length, dtype, True)
            ref_all = torch.empty(length * n, dtype=dtype)
            dist.all_gather_into_tensor(ref_all, inp)
            for algo in algorithms("allgather") if length in (0, 1, n + 1, LARGE_ODD) else []:
                key = f"allgather/{dname}/{length}/{algo}"
                out = torch.zeros(length * n, dtype=dtype)
                C.all_gather_into_tensor(out, inp, algorithm=algo)
                check.digests[key] = digest(out)
                check.same(key, out, ref_all)
            # --- broadcast from the first and the last rank
            for src in sorted({0, n - 1}) if length == n + 1 else [n - 1]:
                want = make_input(length + 3, src, length, dtype, False)
                for algo in algorithms("broadcast"):
                    key = f"broadcast/{dname}/{length}/src{src}/{algo}"
                    t = want.clone() if rank == src else torch.zeros(length, dtype=dtype)
                    C.broadcast(t, src, algorithm=algo)
                    check.digests[key] = digest(t)
                    check.same(key, t, want)
    return check.result()


def _as_if_coalescing(self: Peers, device: torch.device) -> bool:
    return True


def stream_ordered(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """The matrix in float32 and int64 on gloo, with Peers treating the backend as NCCL: every post
    goes through batch_isend_irecv and every receive is posted along with its step's sends
    (Peers.can_prepost is False), the ring's two alternating scratch areas included. Only Peers.post's
    branch for a batch that comes back as a single work (NCCL's) cannot run here: gloo returns one
    work per operation."""
    Peers._needs_coalescing = _as_if_coalescing  # type: ignore[method-assign]
    batches = 0
    batch_isend_irecv = dist.batch_isend_irecv

    def counted(ops: list[dist.P2POp]) -> list[dist.Work]:
        nonlocal batches
        batches += 1
        return batch_isend_irecv(ops)

    dist.batch_isend_irecv = counted
    result = matrix(rank, n, [torch.float32, torch.int64])
    if n > 1 and batches == 0:
        result["failures"].append("no message went through batch_isend_irecv")
    return result


def subgroup(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """Ranks [1, 3, 4] of 6 and, at the same time, ranks [0, 2, 5] run every op on their own group."""
    check = Checker()
    # new_group() returns a ProcessGroup to members and a marker to the others: both are valid inputs.
    groups = {
        (1, 3, 4): cast(dist.ProcessGroup, dist.new_group([1, 3, 4])),
        (0, 2, 5): cast(dist.ProcessGroup, dist.new_group([0, 2, 5])),
    }
    members = next(m for m in groups if rank in m)
    group = groups[members]
    other = groups[next(m for m in groups if rank not in m)]
    me = members.index(rank)
    size = len(members)
    # A non-member gets None back and its tensor untouched, as with torch.
    untouched = torch.ones(4)
    if C.all_reduce(untouched, group=other) is not None or not torch.equal(untouched, torch.ones(4)):
        check.fail("a non-member's all_reduce must return None and leave the tensor alone")
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for length in (0, 1, size + 1, 1001):
            x = make_input(length, rank, length, dtype, True)
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            for algo in algorithms("allreduce"):
                mine = x.clone()
                C.all_reduce(mine, group=group, algorithm=algo)
                key = f"{members}/allreduce/{dtype}/{length}/{algo}"
                check.same(key, mine, ref)
                check.digests[key] = digest(mine)
            xin = make_input(length + 1, rank, length * size, dtype, True)
            ref_out = torch.empty(length, dtype=dtype)
            dist.reduce_scatter_tensor(ref_out, xin, group=group)
            ref_all = torch.empty(length * size, dtype=dtype)
            dist.all_gather_into_tensor(ref_all, x, group=group)
            for algo in algorithms("reduce_scatter"):
                out = torch.empty(length, dtype=dtype)
                C.reduce_scatter_tensor(out, xin, group=group, algorithm=algo)
                check.same(f"{members}/reduce_scatter/{dtype}/{length}/{algo}", out, ref_out)
                gathered = torch.empty(length * size, dtype=dtype)
                C.all_gather_into_tensor(gathered, x, group=group, algorithm=algo)
                check.same(f"{members}/allgather/{dtype}/{length}/{algo}", gathered, ref_all)
            for algo in algorithms("broadcast"):
                # src is a global rank, as in torch: the last member; group_src=0 is the first.
                t = x.clone()
                C.broadcast(t, members[-1], group=group, algorithm=algo)
                check.same(
                    f"{members}/broadcast-src/{algo}", t, make_input(length, members[-1], length, dtype, True)
                )
                t = x.clone()
                C.broadcast(t, group=group, group_src=0, algorithm=algo)
                check.same(
                    f"{members}/broadcast-group_src/{algo}",
                    t,
                    make_input(length, members[0], length, dtype, True),
                )
    result = check.result()
    result["members"] = members
    result["group_rank"] = me
    return result


def concurrent(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """Several async ops on different tensors (and groups) in flight at once, then a sync call."""
    check = Checker()
    everyone = list(range(n))
    pair = cast(dist.ProcessGroup, dist.new_group([0, 1]))
    big = [make_input(1, r, LARGE_ODD, torch.float32, True) for r in everyone]
    ints = [make_input(2, r, 5_000, torch.int64, True) for r in everyone]
    rs_in = [make_input(3, r, 999 * n, torch.float64, True) for r in everyone]
    ag_in = make_input(4, rank, 777, torch.bfloat16, True)
    a = big[rank].clone()
    b = ints[rank].clone()
    c = torch.empty(999, dtype=torch.float64)
    d = torch.empty(777 * n, dtype=torch.bfloat16)
    e = make_input(5, rank, 12_345, torch.float16, True)
    f = big[rank][:10].clone()
    g = ints[rank][:100].clone()
    # 16 MiB: big enough for the default policy to cut each ring chunk / HD half into 2 segments.
    huge = [torch.full((1 << 22,), float(r + 1)) for r in everyone]
    i_ring, i_hd = huge[rank].clone(), huge[rank].clone()
    works = [
        C.all_reduce(a, algorithm="ring", async_op=True),
        C.all_reduce(b, dist.ReduceOp.MAX, algorithm="hd", async_op=True),
        C.reduce_scatter_tensor(c, rs_in[rank], algorithm="ring", async_op=True),
        C.all_gather_into_tensor(d, ag_in, algorithm="hd", async_op=True),
        C.broadcast(e, n - 1, algorithm="ring", async_op=True),
        C.all_reduce(f, async_op=True),
        C.all_reduce(i_ring, algorithm="ring", async_op=True),
        C.all_reduce(i_hd, algorithm="hd", async_op=True),
    ]
    pair_work = C.all_reduce(g, group=pair, algorithm="rd", async_op=True) if rank < 2 else None
    # A synchronous call while async ones are queued runs after them, in order, on every rank.
    h = torch.full((3,), float(rank))
    C.all_reduce(h, algorithm="hd")
    for work in reversed(works):
        assert work is not None
        work.wait()
        if not work.is_completed():
            check.fail("is_completed() is False after wait()")
    if pair_work is not None:
        pair_work.wait()
        check.same("pair", g, ints[0][:100] + ints[1][:100])
    check.same("a", a, torch.stack(big).sum(0))
    check.same("b", b, torch.stack(ints).max(0).values)
    check.same("c", c, torch.stack(rs_in).sum(0)[rank * 999 : (rank + 1) * 999])
    check.same("d", d, torch.cat([make_input(4, r, 777, torch.bfloat16, True) for r in everyone]))
    check.same("e", e, make_input(5, n - 1, 12_345, torch.float16, True))
    check.same("f", f, torch.stack(big).sum(0)[:10])
    check.same("i_ring", i_ring, torch.stack(huge).sum(0))
    check.same("i_hd", i_hd, torch.stack(huge).sum(0))
    check.same("h", h, torch.full((3,), float(sum(everyone))))
    return check.result()


def many_small(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """Hundreds of tiny calls in a row, cycling algorithms and ops, each checked."""
    check = Checker()
    calls = int(arg)
    cycle = algorithms("allreduce")
    for i in range(calls):
        length = 1 + i % 3
        x = torch.full((length,), float(rank + i))
        C.all_reduce(x, algorithm=cycle[i % len(cycle)])
        check.same(f"call {i}", x, torch.full((length,), float(sum(range(n)) + n * i)))
        if i % 10 == 0:
            t = torch.tensor([i if rank == i % n else -1])
            C.broadcast(t, i % n)
            check.same(f"broadcast {i}", t, torch.tensor([i]))
    return check.result()


def auto_trials(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """Auto's trials on two kinds of call, interleaved: every call exact, what ran and kept recorded."""
    from dtjob.trainer.collectives.tuning import call_kind
    from dtjob.trainer.collectives.work import runner_for

    os.environ["DTJOB_COLLECTIVE_TRIALS"] = str(arg)
    check = Checker()
    lengths = {"small": 1_000, "large": 300_000}  # 4 KB and 1.2 MB of float32
    ran: dict[str, list[str | None]] = {name: [] for name in lengths}
    for i in range(60):  # enough for two blocks of every candidate and calls after (test_collectives)
        for name, length in lengths.items():
            x = make_input(i, rank, length, torch.float32, exact=True)
            expected = x.clone()
            dist.all_reduce(expected)
            C.all_reduce(x)
            check.same(f"{name} call {i}", x, expected)
            ran[name].append(C.last_algorithm("allreduce"))
            check.digests[f"{name} {i}"] = digest(x)
    del os.environ["DTJOB_COLLECTIVE_TRIALS"]
    trials = runner_for(cast(dist.ProcessGroup, dist.group.WORLD)).trials
    candidates = {
        name: list(trials[call_kind("allreduce", length * 4, "float32")].candidates)
        for name, length in lengths.items()
    }
    return {**check.result(), "ran": ran, "candidates": candidates}


def dead_peer(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """The last rank dies after one good collective; the others' next calls must raise, not hang."""

    x = torch.ones(10)
    C.all_reduce(x)
    if rank == n - 1:
        os._exit(3)
    outcome: dict[str, Any] = {}
    for name, algo, async_op in (("ring", "ring", False), ("hd-async", "hd", True)):
        start = time.monotonic()
        try:
            work = C.all_reduce(torch.ones(10_000), algorithm=algo, async_op=async_op)
            if work is not None:
                work.wait()
            outcome[name] = "returned"
        except RuntimeError as error:
            outcome[name] = f"raised: {str(error)[:200]}"
        outcome[f"{name}-seconds"] = time.monotonic() - start
    return outcome


def errors_and_layouts(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """Bad arguments raise clear errors before any message is sent; odd layouts still work."""
    check = Checker()

    def expect(error: type[Exception], words: str, call: Any) -> None:
        try:
            call()
        except error as raised:
            if words not in str(raised):
                check.fail(f"{error.__name__} without {words!r}: {raised}")
            return
        check.fail(f"expected {error.__name__} mentioning {words!r}")

    expect(
        ValueError,
        f"world_size ({n})",
        lambda: C.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * n + 1)),
    )
    expect(ValueError, "output_tensor", lambda: C.all_gather_into_tensor(torch.empty(5), torch.empty(2)))
    expect(
        TypeError,
        "dtype",
        lambda: C.all_gather_into_tensor(torch.empty(2 * n), torch.empty(2, dtype=torch.int64)),
    )
    expect(TypeError, "uint32", lambda: C.all_reduce(torch.ones(3, dtype=torch.uint32)))
    expect(TypeError, "torch.Tensor", lambda: C.all_reduce(cast(torch.Tensor, [1.0])))
    expect(ValueError, "algorithm='tree'", lambda: C.all_reduce(torch.ones(3), algorithm="tree"))
    expect(ValueError, "src", lambda: C.broadcast(torch.ones(3), n + 5))
    os.environ["DTJOB_COLLECTIVE_ALGO"] = "allreduce:bogus"
    expect(ValueError, "DTJOB_COLLECTIVE_ALGO", lambda: C.all_reduce(torch.ones(3)))
    os.environ["DTJOB_COLLECTIVE_ALGO"] = ""
    os.environ["DTJOB_COLLECTIVE_TRIALS"] = "some"
    expect(ValueError, "DTJOB_COLLECTIVE_TRIALS='some'", lambda: C.all_reduce(torch.ones(3), async_op=True))
    del os.environ["DTJOB_COLLECTIVE_TRIALS"]
    # The override is honoured (and an explicit keyword beats it).
    os.environ["DTJOB_COLLECTIVE_ALGO"] = "allreduce:hd;broadcast:tree"
    C.all_reduce(torch.ones(8))
    if C.last_algorithm("allreduce") != "hd":
        check.fail(f"DTJOB_COLLECTIVE_ALGO=allreduce:hd ran {C.last_algorithm('allreduce')}")
    C.all_reduce(torch.ones(8), algorithm="ring")
    if C.last_algorithm("allreduce") != "ring":
        check.fail("algorithm='ring' must beat the environment override")
    del os.environ["DTJOB_COLLECTIVE_ALGO"]
    # Non-contiguous tensors: a transposed matrix, a strided output.
    m = (torch.arange(12.0).reshape(3, 4) + rank).t()
    C.all_reduce(m, algorithm="ring")
    check.same("transposed", m, (torch.arange(12.0).reshape(3, 4) * n + sum(range(n))).t())
    storage = torch.zeros(2 * n * 3)
    strided = storage[::2]
    C.all_gather_into_tensor(strided, torch.full((3,), float(rank)), algorithm="hd")
    check.same("strided", strided, torch.arange(n, dtype=torch.float32).repeat_interleave(3))
    # reduce_scatter into a 2-D output from a 2-D input (only numel matters, as in torch)
    out2 = torch.empty(2, 3)
    C.reduce_scatter_tensor(out2, torch.ones(2 * n, 3), algorithm="hd")
    check.same("2d", out2, torch.full((2, 3), float(n)))
    return check.result()


def aliased_output(rank: int, n: int, per_rank: int) -> dict[str, Any]:
    """reduce_scatter into a view of its own input: its own chunk, or chunk 0 on every rank. The
    algorithms read the input while they write the output, and sends of a multi-MiB chunk are still
    in flight then (direct, 4 ranks, 4 MiB chunks: wrong every time when they were not kept apart)."""
    check = Checker()
    want = torch.arange(per_rank * rank, per_rank * (rank + 1), dtype=torch.float64) * n + sum(range(n))
    for algo in algorithms("reduce_scatter"):
        for first in (per_rank * rank, 0):
            whole = torch.arange(per_rank * n, dtype=torch.float64) + rank  # exact sums in float64
            if rank == 0:
                time.sleep(0.05)  # a late rank: the others' sends to it wait, reading their input
            C.reduce_scatter_tensor(whole[first : first + per_rank], whole, algorithm=algo)
            check.same(f"aliased/{algo}/from {first}", whole[first : first + per_rank], want)
    return check.result()


def trainer_comm_metrics(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """The trainer's Comm with every algorithm choice, as the strategies call it, and the metric
    labels it reports: the algorithm that ran (auto resolved), sync and async alike."""
    from dtjob.trainer.comm_metrics import instrument_comm
    from dtjob.trainer.metrics import TrainerMetrics
    from dtjob.trainer.parallel.comm import Comm

    metrics = TrainerMetrics()
    instrument_comm(metrics)
    labels: dict[str, list[str]] = {}
    for algorithm in ("auto", "direct", "native"):
        comm = Comm(algorithm)
        small, large = torch.full((8,), float(rank)), torch.full((1 << 20,), float(rank))
        comm.all_reduce_sum(small)
        comm.all_reduce_sum(large, async_op=True).wait()
        gathered = torch.empty(2 * n)
        comm.all_gather(gathered, torch.full((2,), float(rank)))
        scattered = torch.empty(2)
        comm.reduce_scatter_sum(scattered, torch.ones(2 * n))
        shared = torch.full((5,), float(rank))
        comm.broadcast(shared, src_group_rank=n - 1)
        comm.all_reduce_sum(torch.empty(0))  # sends nothing: labelled "none", not the previous call
        total = float(sum(range(n)))
        if not (bool((small == total).all()) and bool((large == total).all())):
            raise AssertionError(f"{algorithm}: all_reduce_sum gave {small[0]}/{large[0]}, not {total}")
        if gathered.tolist() != [float(r) for r in range(n) for _ in range(2)]:
            raise AssertionError(f"{algorithm}: all_gather gave {gathered.tolist()}")
        if scattered.tolist() != [float(n)] * 2 or shared.tolist() != [float(n - 1)] * 5:
            raise AssertionError(f"{algorithm}: reduce_scatter {scattered.tolist()}, bcast {shared.tolist()}")
    # The pipeline's point-to-point messages: an async send one way, a blocking one back.
    comm, peer = Comm("auto"), (rank + 1) % n
    outgoing, incoming = torch.full((3,), float(rank)), torch.empty(3)
    if rank % 2 == 0:
        comm.send(outgoing, peer, tag=7, async_op=True).wait()
        comm.recv(incoming, (rank - 1) % n, tag=7)
    else:
        comm.recv(incoming, (rank - 1) % n, tag=7)
        comm.send(outgoing, peer, tag=7)
    if incoming.tolist() != [float((rank - 1) % n)] * 3:
        raise AssertionError(f"recv gave {incoming.tolist()}")
    for family in metrics.collective_calls.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                labels.setdefault(sample.labels["algorithm"], []).append(sample.labels["op"])
    p2p_send = {"op": "send", "algorithm": "p2p"}
    sent = metrics.registry.get_sample_value("dtjob_trainer_collective_bytes_total", p2p_send)
    return {"labels": {k: sorted(v) for k, v in labels.items()}, "p2p_bytes_sent": sent}
