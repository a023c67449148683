"""Ring reduce-scatter and all-gather with segmented pipelining; ring all-reduce is the two in a row.

The buffer is cut into one chunk per rank (`bounds`, n+1 offsets). In step s of the reduce-scatter
rank r sends chunk (r-s-1) to r+1 and receives chunk (r-s-2) from r-1, which it reduces into its own
copy; after n-1 steps chunk r holds everybody's contribution, reduced along one fixed path (starting
at rank r+1), so every element has exactly one owner and one summation order. The all-gather then
forwards owned chunks around the ring unchanged, so every rank ends with the same bytes.

Each chunk is cut into the same number k of segments (balanced, possibly empty) so that segment j of
step s is the very region sent as segment j of step s+1: as soon as segment j is reduced it is sent
on while segment j+1 is still arriving. That is gloo's segmented ring: transfer and reduction overlap.
"""

from __future__ import annotations

import torch

from dtjob.trainer.collectives.comm import Comm, balanced_bounds, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction


def _segments(bounds: list[int], chunk: int, k: int) -> list[tuple[int, int]]:
    lo = bounds[chunk]
    sub = balanced_bounds(bounds[chunk + 1] - lo, k)
    return [(lo + sub[j], lo + sub[j + 1]) for j in range(k)]


def _segment_count(comm: Comm, buf: torch.Tensor, bounds: list[int]) -> int:
    largest = max(bounds[i + 1] - bounds[i] for i in range(comm.size))
    return comm.segments(largest, buf.element_size())


def reduce_scatter(comm: Comm, buf: torch.Tensor, bounds: list[int], reduction: Reduction) -> None:
    """In place on the flat `buf`: afterwards chunk `comm.rank` holds the finished reduction."""
    n, r = comm.size, comm.rank
    if n > 1:
        nxt, prv = (r + 1) % n, (r - 1) % n
        k = _segment_count(comm, buf, bounds)
        largest = max(bounds[i + 1] - bounds[i] for i in range(n))
        # Two receive areas, alternating by step: step s+1 receives while step s is being reduced.
        scratch = [comm.scratch(0, largest, buf), comm.scratch(1, largest if n > 2 else 0, buf)]
        sends = []

        def recv_area(step: int, seg: tuple[int, int], chunk_lo: int) -> torch.Tensor:
            return scratch[step % 2][seg[0] - chunk_lo : seg[1] - chunk_lo]

        first_send = _segments(bounds, (r - 1) % n, k)
        recv_chunk = (r - 2) % n
        recv_segs = _segments(bounds, recv_chunk, k)
        recvs = []
        for j in range(k):
            s_seg, r_seg = first_send[j], recv_segs[j]
            sw, rw = comm.post(
                sends=[(buf[s_seg[0] : s_seg[1]], nxt)],
                recvs=[(recv_area(0, r_seg, bounds[recv_chunk]), prv)],
            )
            sends += sw
            recvs.append(rw)
        for step in range(n - 1):
            chunk = (r - step - 2) % n
            segs = _segments(bounds, chunk, k)
            next_chunk = (r - step - 3) % n
            next_segs = _segments(bounds, next_chunk, k)
            next_recvs = []
            for j in range(k):
                wait_all(recvs[j])
                lo, hi = segs[j]
                reduction.combine(buf[lo:hi], recv_area(step, segs[j], bounds[chunk]))
                if step + 1 < n - 1:
                    sw, rw = comm.post(
                        sends=[(buf[lo:hi], nxt)],
                        recvs=[(recv_area(step + 1, next_segs[j], bounds[next_chunk]), prv)],
                    )
                    sends += sw
                    next_recvs.append(rw)
            recvs = next_recvs
        wait_all(sends)
    reduction.finish(buf[bounds[r] : bounds[r + 1]], n)


def all_gather(comm: Comm, buf: torch.Tensor, bounds: list[int]) -> None:
    """In place on the flat `buf`: chunk `comm.rank` is valid before, every chunk after."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    k = _segment_count(comm, buf, bounds)
    sends = []
    recvs = []
    own = _segments(bounds, r, k)
    first_recv = _segments(bounds, (r - 1) % n, k)
    for j in range(k):
        sw, rw = comm.post(
            sends=[(buf[own[j][0] : own[j][1]], nxt)],
            recvs=[(buf[first_recv[j][0] : first_recv[j][1]], prv)],
        )
        sends += sw
        recvs.append(rw)
    for step in range(n - 1):
        segs = _segments(bounds, (r - step - 1) % n, k)
        next_segs = _segments(bounds, (r - step - 2) % n, k)
        next_recvs = []
        for j in range(k):
            wait_all(recvs[j])
            if step + 1 < n - 1:
                sw, rw = comm.post(
                    sends=[(buf[segs[j][0] : segs[j][1]], nxt)],
                    recvs=[(buf[next_segs[j][0] : next_segs[j][1]], prv)],
                )
                sends += sw
                next_recvs.append(rw)
        recvs = next_recvs
    wait_all(sends)


def all_reduce(comm: Comm, buf: torch.Tensor, reduction: Reduction) -> None:
    """Ring all-reduce of the flat `buf` in place: reduce-scatter, then all-gather."""
    bounds = balanced_bounds(buf.numel(), comm.size)
    reduce_scatter(comm, buf, bounds, reduction)
    all_gather(comm, buf, bounds)
