"""Hierarchical all-reduce ("hier"): inside each worker pod, then across pods, then inside again.

With several processes per worker pod (LOCAL_WORLD_SIZE = L > 1, global rank = pod x L + local
rank) the links inside a pod (NVLink, shared memory) are much faster than those between pods. So:

1. reduce-scatter inside the pod: each of the pod's k members ends with one k-th of the
   vector summed over the pod (ring);
2. all-reduce that k-th across pods, among the members with the same index in their pods (ring):
   each inter-pod link carries 2(P-1)/P of a k-th instead of the flat ring's share of the whole;
3. all-gather inside the pod (ring).

It is built from the ring's pieces over subsets of the group (Peers.subset), each phase with its
own tag; AVG divides once, by the whole group's size, on the finished k-th before the
all-gather, so every rank ends with the same bits.

Which groups it applies to ("aligned"): members of at least two pods, the same number k >= 2 of
them in every pod. A subgroup qualifies too (e.g. ranks 0, 1, 3, 4 with L = 3: two pods of two);
the phase-2 peers are then the members with the same index among their pod's members. Any other
group: `algorithm="hier"` raises an InvalidArgument naming the layout, DTJOB_COLLECTIVE_ALGO's
allreduce:hier leaves the call to auto (an environment setting covers groups of every shape), and
auto does not consider it. LOCAL_WORLD_SIZE must be the same on every rank (dtjob's launcher and
torchrun with one --nproc-per-node set it so); auto checks that before it considers hier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dtjob import contract
from dtjob.trainer.collectives import ring
from dtjob.trainer.collectives.errors import InvalidArgument
from dtjob.trainer.collectives.peers import Peers, balanced_bounds
from dtjob.trainer.collectives.reduce_ops import Reduction

LOCAL_WORLD_SIZE_ENV = contract.ENV_LOCAL_WORLD_SIZE


@dataclass(frozen=True)
class PodLayout:
    """An aligned group: `pods[p][j]` is the group rank of the j-th member of the p-th pod."""

    pods: tuple[tuple[int, ...], ...]

    @property
    def shape(self) -> tuple[int, int]:
        """(pods, members per pod)."""
        return len(self.pods), len(self.pods[0])

    def position(self, group_rank: int) -> tuple[int, int]:
        """(pod index, index within the pod) of a member."""
        for p, members in enumerate(self.pods):
            if group_rank in members:
                return p, members.index(group_rank)
        raise ValueError(f"group rank {group_rank} is not in the layout")


def local_world_size(explicit: int | None) -> int:
    """The processes per pod: the argument, else LOCAL_WORLD_SIZE, else 1."""
    if explicit is not None:
        if not isinstance(explicit, int) or explicit < 1:
            raise InvalidArgument(f"local_world_size must be a whole number >= 1, got {explicit!r}")
        return explicit
    try:
        local: int = contract.PodEnv.read(contract.ENV_LOCAL_WORLD_SIZE)
        return local
    except contract.PodEnvError as err:
        raise InvalidArgument(str(err)) from None


def pod_layout(global_ranks: Sequence[int], local_size: int) -> PodLayout | str:
    """The group's pods (its members' global ranks in group-rank order), or why it is not aligned."""
    if local_size < 2:
        return f"one process per pod (LOCAL_WORLD_SIZE={local_size}): there is no pod to reduce inside"
    pods: dict[int, list[int]] = {}
    for group_rank, global_rank in enumerate(global_ranks):
        pods.setdefault(global_rank // local_size, []).append(group_rank)
    counts = sorted({len(m) for m in pods.values()})
    if len(pods) < 2:
        return f"all {len(global_ranks)} members are in one pod (LOCAL_WORLD_SIZE={local_size})"
    if len(counts) > 1 or counts[0] < 2:
        per_pod = {pod: len(m) for pod, m in sorted(pods.items())}
        return (
            f"members per pod {per_pod} (LOCAL_WORLD_SIZE={local_size}): hier needs the same number, "
            "at least 2, in every pod"
        )
    return PodLayout(tuple(tuple(pods[p]) for p in sorted(pods)))


def all_reduce(peers: Peers, buf: torch.Tensor, reduction: Reduction, layout: PodLayout) -> None:
    """Hierarchical all-reduce of the flat `buf` in place on `peers` (the whole group)."""
    p, j = layout.position(peers.group_rank(peers.rank))
    k = layout.shape[1]
    inside = peers.subset(layout.pods[p], phase=1)
    across = peers.subset([members[j] for members in layout.pods], phase=2)
    gather = peers.subset(layout.pods[p], phase=3)
    phase = reduction.without_finish()
    bounds = balanced_bounds(buf.numel(), k)
    mine = buf[bounds[j] : bounds[j + 1]]
    ring.reduce_scatter_in_place(inside, buf, bounds, phase)
    if mine.numel():  # the same on every member with index j: their vectors have one length
        ring.all_reduce(across, mine, phase)
    reduction.finish(mine, peers.size)
    ring.all_gather(gather, buf, bounds)
