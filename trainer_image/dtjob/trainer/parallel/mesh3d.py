"""`mesh(dp=, tp=, pp=)`: the process groups of 3-D parallelism over the default process group.

    m = mesh(dp=2, tp=2, pp=2)                                  # world 8
    model = tensor_parallel(model, "auto", group=m.tp)         # the processes of one pod
    pipe = pipeline(model, stages=m.pp_size, group=m.dp_pp)    # stages across pods, replicas over DP
    # or, without a pipeline: fully_shard(model, zero_stage=2, group=m.dp) / data_parallel(..., group=m.dp)

Layout (Megatron's order): rank = (dp_rank * pp + pp_rank) * tp + tp_rank. A TP group is `tp`
consecutive ranks, the processes of one pod (its all-reduces, two per layer, are the most
frequent: they stay on NVLink), pipeline stages are next, data parallel outermost (its gradient
reduction happens once per step). `dp_pp` holds the ranks of one TP coordinate: a pipeline over it
numbers them replica * pp + stage, which is (dp_rank, pp_rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from dtjob import contract
from dtjob.trainer.parallel.comm import new_group


@dataclass(frozen=True)
class Mesh:
    """This rank's groups (for `group=`) and coordinates in a dp x pp x tp mesh."""

    dp_size: int
    pp_size: int
    tp_size: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_pp: dist.ProcessGroup  # the ranks of this TP coordinate: a pipeline's group=


def _size(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"mesh: {name} must be a whole number >= 1, got {value!r}")
    return value


def _mine(groups: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Create every group (all ranks, same order: dist.new_group's rule) and return this rank's."""
    found = None
    for ranks in groups:
        group = new_group(ranks)
        if rank in ranks:
            found = group
    assert found is not None
    return found


def mesh(*, dp: int = 1, tp: int = 1, pp: int = 1) -> Mesh:
    """The 3-D mesh over the default process group; world size must be dp * tp * pp. Every rank
    must call it at the same point (it creates process groups, a collective)."""
    if not dist.is_initialized():
        raise RuntimeError("mesh() needs torch.distributed.init_process_group() to be called first")
    dp, tp, pp = _size("dp", dp), _size("tp", tp), _size("pp", pp)
    world, rank = dist.get_world_size(), dist.get_rank()
    if dp * tp * pp != world:
        raise ValueError(
            f"mesh: dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} processes, but the world size is {world}"
        )
    local = contract.PodEnv.read(contract.ENV_LOCAL_WORLD_SIZE)
    if os.environ.get(contract.ENV_LOCAL_WORLD_SIZE) and local % tp:  # known in a pod only
        raise ValueError(
            f"mesh: tp={tp} must divide the processes per pod ({contract.ENV_LOCAL_WORLD_SIZE}={local}, "
            "spec.nprocPerWorker): a tensor-parallel group stays inside one pod"
        )

    def at(d: int, p: int, t: int) -> int:
        return (d * pp + p) * tp + t

    coords = [(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
    d0, p0, t0 = coords[rank]
    tp_groups = [[at(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)]
    pp_groups = [[at(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    dp_groups = [[at(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    dp_pp_groups = [[at(d, p, t) for d in range(dp) for p in range(pp)] for t in range(tp)]
    return Mesh(
        dp_size=dp,
        pp_size=pp,
        tp_size=tp,
        dp_rank=d0,
        pp_rank=p0,
        tp_rank=t0,
        tp=_mine(tp_groups, rank),
        pp=_mine(pp_groups, rank),
        dp=_mine(dp_groups, rank),
        dp_pp=_mine(dp_pp_groups, rank),
    )
