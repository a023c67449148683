"""How the strategies move data: dtjob's collectives (auto / ring / hd / direct) or torch's native ones.

`Comm` binds a process group and an algorithm. Every strategy talks only to a `Comm`, so one
config field (`ParallelConfig.collective`) swaps the whole data path:

- "native": `torch.distributed` collectives on the group (gloo here), asynchronous via async_op.
- "auto" / "ring" / "hd" / "direct" / "hier": `dtjob.trainer.collectives` with `algorithm=` that value,
  also asynchronous via async_op (they run a group's collectives in call order on one worker
  thread). Direct has no broadcast, and hier (the hierarchical all-reduce, for pods of several
  processes) is an all-reduce only; the ops they lack use "auto". On a group hier does not apply
  to (one pod, one process per pod, or unequal pods: what an elastic job becomes after a rescale)
  its all-reduces use "auto" too, as DTJOB_COLLECTIVE_ALGO's allreduce:hier does: a job's
  `--collective=hier` must survive every world size its elastic bounds allow.

All sums are averaged by the strategies themselves (divide after SUM), so the result does not
depend on which ops an algorithm supports.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

# The values of every wrapper's `collective=`: dtjob's algorithms, or torch's own collectives.
COLLECTIVES = ("auto", "ring", "hd", "direct", "hier", "native")
# Algorithms some ops lack: those ops use "auto" under them (hier is an all-reduce only, direct has
# no broadcast).
_PARTIAL = {"hier", "direct"}


class Handle(Protocol):
    def wait(self) -> Any: ...


class _Done:
    """A handle for work that already finished."""

    def wait(self) -> None:
        return None


class Comm:
    """Collectives over one process group with one algorithm."""

    def __init__(self, algorithm: str = "native", group: dist.ProcessGroup | None = None) -> None:
        if algorithm not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {algorithm!r}")
        self.algorithm = algorithm
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # Where this group's tensors live: NCCL only moves CUDA tensors.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._ops: Any = dist
        self._extra: dict[str, str] = {}
        self._auto: dict[str, str] = {}
        if algorithm != "native":
            from dtjob.trainer import collectives  # imported lazily: only needed for dtjob's own

            self._ops = collectives
            self._extra = {"algorithm": algorithm}
            self._auto = {"algorithm": "auto"}
            if algorithm == "hier" and not self._pods_aligned():
                self._extra = self._auto

    @property
    def _others(self) -> dict[str, str]:
        """The keyword for reduce-scatter and all-gather: hier is an all-reduce only."""
        return self._auto if self.algorithm == "hier" else self._extra

    def _pods_aligned(self) -> bool:
        """Whether hier applies to this group: its members in at least two pods, as many in each."""
        from dtjob.trainer.collectives import hierarchical

        ranks = [self.global_rank(r) for r in range(self.size)]
        local = hierarchical.local_world_size(None)
        return not isinstance(hierarchical.pod_layout(ranks, local), str)

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of this group's member `group_rank`."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    @staticmethod
    def _handle(work: Any) -> Handle:
        return work if work is not None else _Done()

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False) -> Handle:
        """Sum `tensor` in place over the group."""
        if self.size == 1:
            return _Done()
        return self._handle(
            self._ops.all_reduce(
                tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op, **self._extra
            )
        )

    def reduce_scatter_sum(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
        """output (len n) = this rank's n-element chunk of the sum of every rank's input (len n * size)."""
        if self.size == 1:
            output.copy_(input)
            return _Done()
        return self._handle(
            self._ops.reduce_scatter_tensor(
                output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op, **self._others
            )
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Handle:
        """output (len n * size) = every rank's input (len n) in rank order."""
        if self.size == 1:
            output.copy_(input)
            return _Done()
        return self._handle(
            self._ops.all_gather_into_tensor(
                output, input, group=self.group, async_op=async_op, **self._others
            )
        )

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0, async_op: bool = False) -> Handle:
        """Copy group member `src_group_rank`'s tensor to every member, in place."""
        if self.size == 1:
            return _Done()
        src = self.global_rank(src_group_rank)
        extra = self._auto if self.algorithm in _PARTIAL else self._extra
        return self._handle(
            self._ops.broadcast(tensor, src=src, group=self.group, async_op=async_op, **extra)
        )

    def send(self, tensor: torch.Tensor, dst: int, tag: int, async_op: bool = False) -> Handle:
        """Point-to-point send to default-group rank `dst` over this group (torch's own p2p
        whatever the algorithm)."""
        if async_op:
            return self._handle(dist.isend(tensor, dst, group=self.group, tag=tag))
        dist.send(tensor, dst, group=self.group, tag=tag)
        return _Done()

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        """Blocking point-to-point receive from default-group rank `src` into `tensor`."""
        dist.recv(tensor, src, group=self.group, tag=tag)

    def batch_p2p(
        self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], tag: int
    ) -> None:
        """Sends to and receives from default-group ranks as one `dist.batch_isend_irecv` (NCCL
        runs them together), sends first, each list in its order; returns when all are done."""
        ops = [dist.P2POp(dist.isend, t, peer, group=self.group, tag=tag) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=self.group, tag=tag) for t, peer in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def default_timeout() -> timedelta:
    """The default group's timeout: init_process_group(timeout=), the job's collective timeout.

    `dist.new_group()` without a timeout does not inherit it but takes torch's default (30 min on
    gloo, 10 on NCCL), so a hung peer inside a subgroup would be found that late."""
    pg = dist.distributed_c10d._get_default_group()
    timeout: timedelta = pg._get_backend(pg._device_types[0]).options._timeout
    return timeout


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> dist.ProcessGroup | None:
    """`dist.new_group` with the default group's timeout (collective: every rank of the world
    calls it, in the same order); None on a rank outside `ranks`."""
    group = dist.new_group(ranks, timeout=default_timeout(), backend=backend)
    return group if isinstance(group, dist.ProcessGroup) else None


_CONTROL: dict[int, dist.ProcessGroup] = {}


def control_group() -> dist.ProcessGroup | None:
    """A gloo group over the whole world for CPU tensors and Python objects (agreements,
    checkpoint indexes), or None where the default group is gloo already.

    Created on first use, which is collective: every rank must reach its first call at the same
    point (the wrappers and ElasticSession call it in their constructors)."""
    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    key = id(world)
    if key not in _CONTROL:
        group = new_group(backend="gloo")
        assert group is not None
        _CONTROL[key] = group
    return _CONTROL[key]


class GroupMaker:
    """Subgroups of a wrapper's group, made on every rank of the world (dist.new_group's rule).

    A wrapper over `group` (a pipeline over mesh().dp_pp) names its subgroups by group ranks; the
    world runs one such wrapper per copy of the group (per TP coordinate), each with its own
    ranks, so every rank creates each subgroup for every copy, copies in order of their first
    rank, and keeps its own. The copies are learnt with one all_gather_object over the world."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        world = dist.get_world_size()
        if group is None:
            self.copies = [list(range(world))]
            return
        mine = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine, group=control_group())
        copies = sorted({tuple(c) for c in every})
        if sorted(r for c in copies for r in c) != list(range(world)) or len({len(c) for c in copies}) > 1:
            raise ValueError(
                f"group=: the ranks' groups {[list(c) for c in copies]} do not split the world into "
                "disjoint copies of one layout; pass each rank its group of dtjob.trainer.mesh()"
            )
        self.copies = [list(c) for c in copies]

    def new_group(self, group_ranks: list[int]) -> dist.ProcessGroup | None:
        """The subgroup of these group ranks, this rank's copy of it (None if not a member)."""
        found = None
        for copy in self.copies:
            made = new_group([copy[r] for r in group_ranks])
            found = made if made is not None else found
        return found
