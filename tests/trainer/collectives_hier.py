"""Scenarios for the hierarchical all-reduce ("hier"), against torch's gloo all-reduce.

`arg` is the processes per pod (LOCAL_WORLD_SIZE): world 4 with 2 is 2x2, world 6 with 3 is 2x3
(two pods of three), world 6 with 2 is 3x2. See collectives_harness.py for how worlds start.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
import torch.distributed as dist

from dtjob.trainer import collectives as C
from tests.trainer.collectives_scenarios import LARGE_ODD, Checker, _rounding_bound, digest, make_input

R = dist.ReduceOp


def _against_torch(
    check: Checker, key: str, rank: int, n: int, x_of: Any, red: Any, exact: bool, **keywords: Any
) -> None:
    x = x_of(rank)
    ref = x.clone()
    dist.all_reduce(ref, red, group=keywords.get("group"))
    mine = x.clone()
    C.all_reduce(mine, red, **keywords)
    if C.last_algorithm("allreduce", keywords.get("group")) != "hier":
        check.fail(f"{key}: ran {C.last_algorithm('allreduce', keywords.get('group'))}, not hier")
    if exact:
        check.same(key, mine, ref)
    else:
        everyone = [x_of(r) for r in range(n)]
        check.close(key, mine, ref, _rounding_bound(n, x.dtype, everyone, ref))
    if keywords.get("group") is None:  # digests are compared over all ranks; a subgroup's are exact
        check.digests[key] = digest(mine)


def hierarchical(rank: int, n: int, local: int) -> dict[str, Any]:
    """hier by keyword, by DTJOB_COLLECTIVE_ALGO and by an explicit local_world_size, every
    dtype class, odd lengths; then subgroups aligned with the pods and not; then auto's view."""
    os.environ[C.LOCAL_WORLD_SIZE_ENV] = str(local)
    os.environ["DTJOB_COLLECTIVE_SEGMENT_BYTES"] = "4096"  # pipelined segments in every phase
    check = Checker()
    pods = n // local
    lengths = sorted({1, local - 1, local + 1, n + 1, 2 * n - 1, 1001, LARGE_ODD})
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64):
        reds = [R.SUM, R.MAX] if not dtype.is_complex else [R.SUM]
        if dtype.is_floating_point or dtype.is_complex:
            reds.append(R.AVG)
        for length in lengths:
            for red in reds:
                if dtype.is_complex:

                    def x_of(r: int, length: int = length) -> torch.Tensor:
                        return torch.view_as_complex(
                            make_input(length, r, 2 * length, torch.float32, True).view(-1, 2)
                        )
                else:

                    def x_of(r: int, length: int = length, dtype: torch.dtype = dtype) -> torch.Tensor:
                        return make_input(length, r, length, dtype, True)

                key = f"{pods}x{local}/{dtype}/{length}/{red}"
                _against_torch(check, key, rank, n, x_of, red, True, algorithm="hier")
    # Random floats: within rounding of torch's sum, and the same bits on every rank.
    for length in (LARGE_ODD, 4097):

        def rand_of(r: int, length: int = length) -> torch.Tensor:
            return make_input(length + 9, r, length, torch.float32, False)

        _against_torch(check, f"random/{length}", rank, n, rand_of, R.SUM, False, algorithm="hier")
    # The environment forces it (algorithm="auto"), and an explicit layout needs no environment.
    os.environ[C.ENV_VAR] = "allreduce:hier"
    _against_torch(
        check, "forced", rank, n, lambda r: make_input(5, r, 999, torch.float32, True), R.SUM, True
    )
    del os.environ[C.ENV_VAR]
    del os.environ[C.LOCAL_WORLD_SIZE_ENV]
    _against_torch(
        check,
        "explicit",
        rank,
        n,
        lambda r: make_input(6, r, 777, torch.int64, True),
        R.SUM,
        True,
        algorithm="hier",
        local_world_size=local,
    )
    os.environ[C.LOCAL_WORLD_SIZE_ENV] = str(local)
    _subgroups(check, rank, n, local)
    return check.result()


def _subgroups(check: Checker, rank: int, n: int, local: int) -> None:
    """Two members of each of the first two pods: aligned. The first pod plus one member of the
    next: not aligned, so algorithm="hier" raises and the environment's hier leaves it to auto."""
    aligned_ranks = [0, 1, local, local + 1]
    ragged_ranks = [*range(local), local]
    aligned = cast(dist.ProcessGroup, dist.new_group(aligned_ranks))
    ragged = cast(dist.ProcessGroup, dist.new_group(ragged_ranks))
    if rank in aligned_ranks:
        _against_torch(
            check,
            "aligned subgroup",
            aligned_ranks.index(rank),
            4,
            lambda r: make_input(7, aligned_ranks[r], 1001, torch.float32, True),
            R.SUM,
            True,
            algorithm="hier",
            group=aligned,
        )
    if rank in ragged_ranks:
        check.cases += 1
        try:
            C.all_reduce(torch.ones(10), algorithm="hier", group=ragged)
            check.fail("hier on a group not aligned with the pods must raise")
        except ValueError as error:
            if "hier" not in str(error) or "per pod" not in str(error):
                check.fail(f"the error must name hier and the layout: {error}")
        os.environ[C.ENV_VAR] = "allreduce:hier"
        x = torch.full((10,), float(rank))
        C.all_reduce(x, group=ragged)
        del os.environ[C.ENV_VAR]
        check.same("ragged, env hier", x, torch.full((10,), float(sum(ragged_ranks))))
        if C.last_algorithm("allreduce", ragged) == "hier":
            check.fail("the environment's hier must leave a ragged group to auto")


def auto_considers_hier(rank: int, n: int, local: int) -> dict[str, Any]:
    """With LOCAL_WORLD_SIZE set alike everywhere, auto times hier among its candidates."""
    from dtjob.trainer.collectives.tuning import call_kind
    from dtjob.trainer.collectives.work import runner_for

    os.environ[C.LOCAL_WORLD_SIZE_ENV] = str(local)
    os.environ["DTJOB_COLLECTIVE_TRIALS"] = "4"
    check = Checker()
    ran = []
    for i in range(40):
        x = make_input(i, rank, 1 << 16, torch.float32, True)  # 256 KiB
        ref = x.clone()
        dist.all_reduce(ref)
        C.all_reduce(x)
        check.same(f"call {i}", x, ref)
        check.digests[f"call {i}"] = digest(x)
        ran.append(C.last_algorithm("allreduce"))
    trials = runner_for(cast(dist.ProcessGroup, dist.group.WORLD)).trials[
        call_kind("allreduce", 1 << 18, "float32")
    ]
    del os.environ["DTJOB_COLLECTIVE_TRIALS"]
    return {**check.result(), "candidates": list(trials.candidates), "ran": ran, "winner": trials.winner}


def strategy_comm(rank: int, n: int, local: int) -> dict[str, Any]:
    """The wrappers' Comm("hier") (a job's --collective=hier): hier where the world spans pods
    alike, auto where it does not (one pod of n: an elastic job shrunk to one pod) - never a raise."""
    from dtjob.trainer.parallel.comm import Comm

    os.environ[C.LOCAL_WORLD_SIZE_ENV] = str(local)
    check = Checker()
    x = torch.full((1000,), float(rank + 1))
    Comm("hier").all_reduce_sum(x)
    check.same("sum", x, torch.full((1000,), float(n * (n + 1) // 2)))
    return {**check.result(), "ran": C.last_algorithm("allreduce")}
