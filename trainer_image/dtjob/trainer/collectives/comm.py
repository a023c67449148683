"""Point-to-point plumbing shared by every algorithm: who my neighbours are, how a buffer is cut.

A `Comm` is one collective call's view of a process group. All traffic goes through
`ProcessGroup.send`/`recv` (what `torch.distributed.isend`/`irecv` call underneath, minus their
per-call Python checks) with the group's own ranks, so subgroups from `new_group` need no
translation here. On a backend that coalesces point-to-point calls (NCCL), each `post` becomes one
`batch_isend_irecv` group so a send and its matching receive are launched together.

Every message of one call carries the call's tag (a per-group sequence number). Gloo delivers
messages of the same (peer, tag) in the order they were posted and every algorithm posts them in
the same order on both ends, so segments need no tag of their own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

# Segmenting policy of the pipelined algorithms: a region sent to one peer in one step (a ring
# chunk, a halving/doubling half) is cut into 2 segments, so reducing the first overlaps receiving
# the second, as gloo's ring does - but only from 2 x 4 MiB up. Each p2p message costs gloo's TCP
# loop thread and ours ~150 us of CPU here (measured: 2 ranks, 1 MiB all-reduce, 2 segments per
# region instead of 1 added 0.7 ms of CPU per call), and with 4-8 ranks on 2 cores there is no idle
# core for the overlap to use, so below that size cutting costs more than it hides.
# Checked at 16 MiB on 4 ranks (4 MiB chunks, so whole-chunk messages), ABBA-paired over 60
# rounds: cutting the chunks into 2 MiB segments took 1.03x the time, into 1 MiB ones 1.09x; and
# receiving into two reused areas (as gloo's own ring does) instead of one area per step, 1.00x.
SEGMENTS_PER_REGION = 2
MIN_SEGMENT_BYTES = 4 << 20
SEGMENT_ENV_VAR = "DTJOB_COLLECTIVE_SEGMENT_BYTES"

Works = list[dist.Work]  # what posting returns: one work per message (none for an empty tensor)


def segments_for(nbytes: float, fixed_segment_bytes: int | None = None) -> int:
    """How many segments a region of `nbytes` is cut into (at least one)."""
    if fixed_segment_bytes:
        return max(1, math.ceil(nbytes / fixed_segment_bytes))
    return max(1, min(SEGMENTS_PER_REGION, math.ceil(nbytes / MIN_SEGMENT_BYTES)))


def whole_number_from_env(name: str, minimum: int, expected: str) -> int | None:
    """The environment variable `name` as a whole number >= `minimum`, or None when unset or empty.

    Anything else raises a ValueError naming the variable, its value and `expected`.
    """
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name}={text!r}: expected {expected}")
    return value


def segment_bytes_from_env() -> int | None:
    """DTJOB_COLLECTIVE_SEGMENT_BYTES (a fixed segment size, like NCCL_BUFFSIZE), or None for the policy."""
    return whole_number_from_env(SEGMENT_ENV_VAR, 1024, "a whole number of bytes >= 1024")


def balanced_bounds(numel: int, parts: int) -> list[int]:
    """Offsets cutting `numel` elements into `parts` pieces whose sizes differ by at most one.

    The first `numel % parts` pieces get the extra element; pieces may be empty when numel < parts.
    """
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class Comm:
    """One collective call on one process group: rank, size, tag and p2p posting."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        tag: int,
        segment_bytes: int | None = None,
        scratch_pool: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] | None = None,
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.tag = tag
        self.segment_bytes = segment_bytes if segment_bytes is not None else segment_bytes_from_env()
        self._coalescing: bool | None = None
        self._pool = scratch_pool if scratch_pool is not None else {}

    def scratch(self, slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A receive buffer of `numel` elements, reused across calls of the group.

        Reuse matters: a fresh multi-MiB buffer is fresh pages, and zero-filling them on first
        touch cost ~20% of a large all-reduce's CPU time here. Calls of one group never overlap
        (work.py), and within a call each slot has one purpose at a time.
        """
        key = (slot, like.dtype, like.device)
        buf = self._pool.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._pool[key] = buf
        return buf[:numel]

    def segments(self, numel: int, element_size: int) -> int:
        """Segments of a region of `numel` elements (identical on both ends: sizes are known to both)."""
        return segments_for(numel * element_size, self.segment_bytes)

    def can_prepost(self, device: torch.device) -> bool:
        """Whether receives may be posted long before their matching sends.

        Gloo: yes, and it pays - a send whose receive is already posted goes out at once, while
        one that arrives first waits for a round trip of ready-notifications (gloo's rendezvous).
        NCCL: no - its p2p calls run in stream order, so a receive posted ahead of the sends it
        depends on would block them; there each receive is posted with the send of its step.
        """
        return not self._needs_coalescing(device)

    def _needs_coalescing(self, device: torch.device) -> bool:
        if self._coalescing is None:
            try:
                backend = self.group._get_backend(device)
                self._coalescing = bool(getattr(backend, "supports_coalescing", False))
            except RuntimeError:
                self._coalescing = False
        return self._coalescing

    def send(self, tensor: torch.Tensor, peer: int) -> Works:
        """Post one send at once; only where receives may be preposted (gloo, see can_prepost)."""
        return [self.group.send([tensor], peer, self.tag)] if tensor.numel() else []

    def recv(self, tensor: torch.Tensor, peer: int) -> Works:
        """Post one receive at once; only where receives may be preposted (gloo, see can_prepost)."""
        return [self.group.recv([tensor], peer, self.tag)] if tensor.numel() else []

    def recv_each(self, tensors: Sequence[torch.Tensor], peer: int) -> list[dist.Work | None]:
        """Post a receive into each tensor at once (gloo only, see can_prepost); None for an empty one."""
        recv, tag = self.group.recv, self.tag
        return [recv([t], peer, tag) if t.numel() else None for t in tensors]

    def post(
        self,
        sends: Sequence[tuple[torch.Tensor, int]] = (),
        recvs: Sequence[tuple[torch.Tensor, int]] = (),
    ) -> tuple[Works, Works]:
        """Start sends and receives (group ranks as peers); empty tensors are skipped on both ends.

        Returns (send works, receive works), in the order given, empty ones left out.
        """
        sends = [(t, p) for t, p in sends if t.numel() > 0]
        recvs = [(t, p) for t, p in recvs if t.numel() > 0]
        if not sends and not recvs:
            return [], []
        device = (sends or recvs)[0][0].device
        if self._needs_coalescing(device):
            ops = [dist.P2POp(dist.irecv, t, group=self.group, tag=self.tag, group_peer=p) for t, p in recvs]
            ops += [dist.P2POp(dist.isend, t, group=self.group, tag=self.tag, group_peer=p) for t, p in sends]
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # coalesced into one work: wait on it for everything
                return list(works), list(works)
            return works[len(recvs) :], works[: len(recvs)]
        recv_works = [self.group.recv([t], p, self.tag) for t, p in recvs]
        send_works = [self.group.send([t], p, self.tag) for t, p in sends]
        return send_works, recv_works


def wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()
