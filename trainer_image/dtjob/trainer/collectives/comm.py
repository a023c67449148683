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

from collections.abc import Sequence

import torch
import torch.distributed as dist

# Default segment size of the pipelined algorithms. 1 MiB: big enough that the ~20-40 us of Python
# per segment stays below 5% of the time to move and reduce it over loopback (~2-4 GB/s on this
# machine's kind), small enough that a 16 MiB chunk is cut into 16 pieces to overlap.
DEFAULT_SEGMENT_BYTES = 1 << 20


def balanced_bounds(numel: int, parts: int) -> list[int]:
    """Offsets cutting `numel` elements into `parts` pieces whose sizes differ by at most one.

    The first `numel % parts` pieces get the extra element; pieces may be empty when numel < parts.
    """
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def segment_count(numel: int, segment_elems: int) -> int:
    """How many segments a region of `numel` elements is cut into (at least one)."""
    return max(1, -(-numel // segment_elems))


class Comm:
    """One collective call on one process group: rank, size, tag and p2p posting."""

    def __init__(
        self, group: dist.ProcessGroup, tag: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES
    ) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.tag = tag
        self.segment_bytes = segment_bytes
        self._coalescing: bool | None = None

    def segment_elems(self, element_size: int) -> int:
        return max(1, self.segment_bytes // element_size)

    def _needs_coalescing(self, device: torch.device) -> bool:
        if self._coalescing is None:
            try:
                backend = self.group._get_backend(device)
                self._coalescing = bool(getattr(backend, "supports_coalescing", False))
            except RuntimeError:
                self._coalescing = False
        return self._coalescing

    def post(
        self,
        sends: Sequence[tuple[torch.Tensor, int]] = (),
        recvs: Sequence[tuple[torch.Tensor, int]] = (),
    ) -> tuple[list[dist.Work], list[dist.Work]]:
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
