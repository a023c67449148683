"""Point-to-point plumbing shared by every algorithm: who my neighbours are, how a buffer is cut.

A `Peers` is one collective call's view of a process group, or of a subset of its members (the
phases of the hierarchical all-reduce): `rank` and `size` count the members, and peers are
given as member indices, translated to the group's ranks here.

Two ways to move a message, chosen by the backend:
- gloo (no coalescing): `ProcessGroup.send`/`recv` straight away (what `torch.distributed.isend`/
  `irecv` call underneath, minus their per-call Python checks). Receives may be posted long
  before their sends (see can_prepost).
- NCCL (a backend that coalesces p2p calls): each `post` is one `batch_isend_irecv` batch, which
  torch runs as one NCCL group (ncclGroupStart/End) on the communicator's stream. Nothing waits
  on the host: `Work.wait()` of an NCCL work makes the caller's current CUDA stream wait for it,
  so the reductions queued after it (on that stream) see the received bytes, and a send posted
  after a reduction reads its result (torch makes the NCCL stream wait for the current stream
  when it launches). CUDA tensors never leave the device. dtypes NCCL has no type for (int16,
  complex as a whole) travel as their bytes.

Every message of one call carries the call's tag (one per phase). Gloo delivers messages of the
same (peer, tag) in the order they were posted and every algorithm posts them in the same order
on both ends, so segments need no tag of their own; NCCL ignores tags and matches by order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

# Segmenting policy of the pipelined algorithms: a region sent to one peer in one step (a ring
# chunk, a halving/doubling half) is cut into 2 segments, so reducing the first overlaps
# receiving the second, as gloo's ring does - but only from 2 x 4 MiB up: below that, the extra
# message (~150 us of CPU in gloo's loop and ours) costs more than the overlap hides where ranks
# outnumber cores (measurements in bench/README.md).
SEGMENTS_PER_REGION = 2
MIN_SEGMENT_BYTES = 4 << 20
SEGMENT_ENV_VAR = "DTJOB_COLLECTIVE_SEGMENT_BYTES"

# The dtypes both torch backends have a type for (torch's ncclDataType map; gloo reduces the same
# set): not int16, the wider unsigned ints or complex. NCCL's send and receive take these as they
# are; other tensors go as their bytes. native.py builds its per-backend tables on this set.
WIRE_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)

Works = list[dist.Work]  # what posting returns: one work per message (none for an empty tensor)
ScratchPool = dict[tuple[int, torch.dtype, torch.device, int], torch.Tensor]


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


def coalesces(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the group's backend for `device` batches p2p calls (NCCL), as batch_isend_irecv
    decides it: the backend's `supports_coalescing`, or, in torch versions without that
    property, whether the tensors are on CUDA."""
    try:
        backend = group._get_backend(device)
    except RuntimeError:
        return False
    flag = getattr(backend, "supports_coalescing", None)
    return bool(flag) if flag is not None else device.type == "cuda"


class Peers:
    """One collective call on a process group (or a subset of its members): rank, size, tag, posting.

    `global_ranks[i]` is the default-group rank of group rank i (what P2POp takes as its peer in
    every torch version); `members`, when set, are the group ranks taking part, in member order.
    `stream_key` names the CUDA stream the call runs on (0 on CPU): scratch buffers are kept per
    stream, so calls on different streams never share one.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        tag: int,
        segment_bytes: int | None = None,
        scratch_pool: ScratchPool | None = None,
        *,
        global_ranks: Sequence[int] | None = None,
        members: Sequence[int] | None = None,
        stream_key: int = 0,
    ) -> None:
        self.group = group
        self.members = tuple(members) if members is not None else None
        me = group.rank()
        self.rank = self.members.index(me) if self.members is not None else me
        self.size = len(self.members) if self.members is not None else group.size()
        self.tag = tag
        self.segment_bytes = segment_bytes if segment_bytes is not None else segment_bytes_from_env()
        self.stream_key = stream_key
        self._global_ranks = tuple(global_ranks) if global_ranks is not None else None
        self._coalescing: bool | None = None
        self._pool: ScratchPool = scratch_pool if scratch_pool is not None else {}

    def subset(self, members: Sequence[int], phase: int) -> Peers:
        """A Peers over `members` (indices into this Peers's members) with the call's `phase`-th tag."""
        sub = Peers(
            self.group,
            self.tag + phase,
            self.segment_bytes,
            self._pool,
            global_ranks=self._global_ranks,
            members=[self.group_rank(m) for m in members],
            stream_key=self.stream_key,
        )
        sub._coalescing = self._coalescing
        return sub

    def group_rank(self, peer: int) -> int:
        """The group rank of member `peer`."""
        return self.members[peer] if self.members is not None else peer

    def _global(self, peer: int) -> int:
        if self._global_ranks is None:
            self._global_ranks = tuple(dist.get_process_group_ranks(self.group))
        return self._global_ranks[self.group_rank(peer)]

    def scratch(self, slot: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A receive buffer of `numel` elements, reused across calls of the group.

        Reuse matters: a fresh multi-MiB buffer is fresh pages, and zero-filling them on first
        touch cost ~20% of a large all-reduce's CPU time. Calls of one group on one stream never
        overlap (work.py), and within a call each slot has one purpose at a time.
        """
        key = (slot, like.dtype, like.device, self.stream_key)
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
            self._coalescing = coalesces(self.group, device)
        return self._coalescing

    def send(self, tensor: torch.Tensor, peer: int) -> Works:
        """Post one send at once; only where receives may be preposted (gloo, see can_prepost)."""
        return [self.group.send([tensor], self.group_rank(peer), self.tag)] if tensor.numel() else []

    def recv(self, tensor: torch.Tensor, peer: int) -> Works:
        """Post one receive at once; only where receives may be preposted (gloo, see can_prepost)."""
        return [self.group.recv([tensor], self.group_rank(peer), self.tag)] if tensor.numel() else []

    def recv_each(self, tensors: Sequence[torch.Tensor], peer: int) -> list[dist.Work | None]:
        """Post a receive into each tensor at once (gloo only, see can_prepost); None for an empty one."""
        recv, tag, source = self.group.recv, self.tag, self.group_rank(peer)
        return [recv([t], source, tag) if t.numel() else None for t in tensors]

    def post(
        self,
        sends: Sequence[tuple[torch.Tensor, int]] = (),
        recvs: Sequence[tuple[torch.Tensor, int]] = (),
    ) -> tuple[Works, Works]:
        """Start sends and receives (member indices as peers); empty tensors are skipped on both ends.

        Returns (send works, receive works), in the order given, empty ones left out. On NCCL the
        batch comes back as one work, returned in both lists: waiting on it covers everything.
        """
        sends = [(t, p) for t, p in sends if t.numel() > 0]
        recvs = [(t, p) for t, p in recvs if t.numel() > 0]
        if not sends and not recvs:
            return [], []
        device = (sends or recvs)[0][0].device
        if self._needs_coalescing(device):
            group, tag = self.group, self.tag
            ops = [dist.P2POp(dist.irecv, _wire(t), self._global(p), group, tag) for t, p in recvs]
            ops += [dist.P2POp(dist.isend, _wire(t), self._global(p), group, tag) for t, p in sends]
            works = dist.batch_isend_irecv(ops)
            if len(works) != len(ops):  # coalesced into one work: wait on it for everything
                return list(works), list(works)
            return works[len(recvs) :], works[: len(recvs)]
        recv_works = [self.group.recv([t], self.group_rank(p), self.tag) for t, p in recvs]
        send_works = [self.group.send([t], self.group_rank(p), self.tag) for t, p in sends]
        return send_works, recv_works


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as NCCL can move it: itself, or its bytes (a view, no copy)."""
    return tensor if tensor.dtype in WIRE_DTYPES else tensor.view(torch.uint8)


def wait_all(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()
