"""Ring reduce-scatter and all-gather with segmented pipelining; ring all-reduce is the two in a row.

The buffer is cut into one chunk per rank (`bounds`, n+1 offsets). In step s of the reduce-scatter
rank r sends chunk (r-s-1) to r+1 and receives chunk (r-s-2) from r-1, which it reduces into its own
copy; after n-1 steps chunk r holds everybody's contribution, reduced along one fixed path (starting
at rank r+1), so every element has exactly one owner and one summation order. The all-gather then
forwards owned chunks around the ring unchanged, so every rank ends with the same bytes.

Each chunk is cut into the same number k of segments (balanced, possibly empty) so that segment j of
step s is the very region sent as segment j of step s+1: as soon as segment j is reduced it is sent
on while segment j+1 is still arriving. That is gloo's segmented ring: transfer and reduction overlap.
On gloo every receive is posted up front (see Peers.can_prepost), each step into its own scratch area;
the all-reduce posts its all-gather's receives before its reduce-scatter's first send.
In the all-reduce the sum of a step lands in buf, not in the scratch area just received; the
reduce-scatter sums into that area and forwards it from there, so that it can leave its input as
it is without copying it (0.7-0.75x the time of reducing a copy in place, bench/README.md).

All data goes one way round, to rank+1: a bidirectional ring (half the buffer each way) took
1.1-1.4x the time on loopback TCP with ranks outnumbering cores.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtjob.trainer.collectives.peers import Peers, Works, balanced_bounds, segments_for, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction


@dataclass(frozen=True)
class _Layout:
    """Where every message of a ring call lies, for one (bounds, rank, segmenting): made once, cached.

    Segment j of chunk c is index c*k + j of `sizes`, the order in which `split_with_sizes` cuts
    the buffer. A call then only indexes tuples: working the offsets out on every call, in Python,
    costs ~400 interpreter calls per 4-rank all-reduce instead of ~130, and where ranks share
    cores that time sits on the ring's critical path.
    """

    sizes: tuple[int, ...]  # elements of every segment, chunk-major
    k: int  # segments per chunk
    largest: int  # elements of the largest chunk: one scratch area
    reduce_first: tuple[int, ...]  # reduce-scatter step 0 sends chunk r-1
    reduce_steps: tuple[tuple[int, ...], ...]  # step s receives chunk r-s-2, reduces and forwards it
    area_sizes: tuple[tuple[int, ...], ...]  # step s's scratch area cut like its chunk (+ padding)
    gather_first: tuple[int, ...]  # all-gather step 0 sends chunk r
    gather_steps: tuple[tuple[int, ...], ...]  # step s receives chunk r-s-1 in place and forwards it


@functools.lru_cache(maxsize=256)
def _layout(bounds: tuple[int, ...], rank: int, element_size: int, segment_bytes: int | None) -> _Layout:
    n = len(bounds) - 1
    largest = max(bounds[c + 1] - bounds[c] for c in range(n))
    k = segments_for(largest * element_size, segment_bytes)
    sizes: list[int] = []
    for c in range(n):
        sub = balanced_bounds(bounds[c + 1] - bounds[c], k)
        sizes += [sub[j + 1] - sub[j] for j in range(k)]

    def chunk(c: int) -> tuple[int, ...]:
        return tuple(c % n * k + j for j in range(k))

    def area(c: int) -> tuple[int, ...]:
        cut = [sizes[i] for i in chunk(c)]
        return (*cut, largest - sum(cut))

    steps = range(n - 1)
    return _Layout(
        sizes=tuple(sizes),
        k=k,
        largest=largest,
        reduce_first=chunk(rank - 1),
        reduce_steps=tuple(chunk(rank - s - 2) for s in steps),
        area_sizes=tuple(area(rank - s - 2) for s in steps),
        gather_first=chunk(rank),
        gather_steps=tuple(chunk(rank - s - 1) for s in steps),
    )


def _layout_of(peers: Peers, buf: torch.Tensor, bounds: list[int]) -> _Layout:
    return _layout(tuple(bounds), peers.rank, buf.element_size(), peers.segment_bytes)


# Every receive of one phase: [step][segment] -> its work; None where the segment is empty (then
# neither end sends it). Filled up front on gloo, step by step on NCCL (see Peers.can_prepost).
Receives = list[list[dist.Work | None]]


def _receives(peers: Peers, targets: Sequence[Sequence[torch.Tensor]], prepost: bool) -> Receives:
    """Post every receive of a phase now (prepost), or make room to post them step by step."""
    if not prepost:
        return [[None] * len(step) for step in targets]
    prv = (peers.rank - 1) % peers.size
    return [peers.recv_each(step, prv) for step in targets]


def _forward_in_stream(
    peers: Peers,
    segment: torch.Tensor,
    into: torch.Tensor,
    sends: Works,
    receives: list[dist.Work | None],
    j: int,
) -> None:
    """NCCL's order: send `segment` on together with the receive of the next step's segment j."""
    sw, rw = peers.post(
        sends=[(segment, (peers.rank + 1) % peers.size)], recvs=[(into, (peers.rank - 1) % peers.size)]
    )
    sends.extend(sw)
    receives[j] = rw[-1] if rw else None


# The loops below run once per message of every call, on the critical path: with ranks
# outnumbering cores, each interpreter call here delays the whole ring. So they keep to locals
# and post gloo's sends through the group directly (up to 1.1x as fast as helper calls per
# message at 1 MiB).


def _reduce(
    peers: Peers,
    buf: torch.Tensor,
    segs: tuple[torch.Tensor, ...],
    lay: _Layout,
    reduction: Reduction,
    prepost: bool,
    post_gather: bool = False,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[Works, Receives | None]:
    """The reduce-scatter's steps, in place in buf, or with `out` (this rank's chunk, cut like it,
    elsewhere) leaving buf as it is: each partial sum then lands in the area it was received in and
    goes on from there, and the last one lands in `out`. Returns the sends, which may still be in
    flight, and, with `post_gather` (preposting only), the all-gather's receives, posted before
    our first send."""
    n, r = peers.size, peers.rank
    steps = n - 1
    # Receive areas: one per step when all receives are posted up front or partial sums are sent
    # on from them, else two alternating.
    areas = steps if prepost or out is not None else min(steps, 2)
    scratch = peers.scratch(0, areas * lay.largest, buf)
    area = [scratch[a * lay.largest : (a + 1) * lay.largest] for a in range(areas)]
    incoming = [area[s % areas].split_with_sizes(lay.area_sizes[s]) for s in range(steps)]
    received = _receives(peers, [inc[: lay.k] for inc in incoming], prepost)  # not the padding
    gather = _receives(peers, _gather_targets(segs, lay), True) if post_gather and prepost else None
    send, nxt, tag, sizes = peers.group.send, peers.group_rank((r + 1) % n), peers.tag, lay.sizes
    sends: Works = []
    for j, i in enumerate(lay.reduce_first):
        if not prepost:
            _forward_in_stream(peers, segs[i], incoming[0][j], sends, received[0], j)
        elif sizes[i]:
            sends.append(send([segs[i]], nxt, tag))
    combine = reduction.combine_out
    last = steps - 1
    for s, chunk in enumerate(lay.reduce_steps):
        inc = incoming[s]
        for j, i in enumerate(chunk):
            total = segs[i] if out is None else out[j] if s == last else inc[j]  # where the sum goes
            work = received[s][j]
            if work is not None:  # None: an empty segment, nothing comes
                work.wait()
                combine(segs[i], inc[j], total)
            if s == last:
                continue
            if not prepost:  # forward the freshly reduced segment
                _forward_in_stream(peers, total, incoming[s + 1][j], sends, received[s + 1], j)
            elif sizes[i]:
                sends.append(send([total], nxt, tag))
    return sends, gather


def reduce_scatter(
    peers: Peers, src: torch.Tensor, out: torch.Tensor, bounds: list[int], reduction: Reduction
) -> None:
    """Reduce the flat `src`, left as it is, into `out`: chunk `peers.rank` of the result.

    Out of place: no copy of src to work in (0.7-0.75x the time of reducing a copy in place).
    """
    if peers.size == 1:
        out.copy_(src[bounds[0] : bounds[1]])
    else:
        lay = _layout_of(peers, src, bounds)
        mine = [lay.sizes[i] for i in lay.reduce_steps[-1]]  # the last step sums our own chunk
        sends, _ = _reduce(
            peers,
            src,
            src.split_with_sizes(lay.sizes),
            lay,
            reduction,
            peers.can_prepost(src.device),
            out=out.split_with_sizes(mine),
        )
        wait_all(sends)
    reduction.finish(out, peers.size)


def reduce_scatter_in_place(peers: Peers, buf: torch.Tensor, bounds: list[int], reduction: Reduction) -> None:
    """In place on the flat `buf`: afterwards chunk `peers.rank` holds the finished reduction and
    the other chunks hold partial sums (the hierarchical all-reduce gathers over them)."""
    if peers.size > 1:
        lay = _layout_of(peers, buf, bounds)
        sends, _ = _reduce(
            peers, buf, buf.split_with_sizes(lay.sizes), lay, reduction, peers.can_prepost(buf.device)
        )
        wait_all(sends)
    reduction.finish(buf[bounds[peers.rank] : bounds[peers.rank + 1]], peers.size)


def _gather_targets(segs: tuple[torch.Tensor, ...], lay: _Layout) -> list[list[torch.Tensor]]:
    """Where each all-gather step receives: its chunk's segments, in place in buf."""
    return [[segs[i] for i in chunk] for chunk in lay.gather_steps]


def _gather(
    peers: Peers, segs: tuple[torch.Tensor, ...], lay: _Layout, posted: Receives | None, sends: Works
) -> None:
    """The all-gather's steps; `posted`: its receives if already up, `sends`: earlier sends to await."""
    prepost = posted is not None or peers.can_prepost(segs[0].device)
    targets = [] if posted is not None else _gather_targets(segs, lay)  # used when not preposted
    received = posted if posted is not None else _receives(peers, targets, prepost)
    send, nxt, tag, sizes = (
        peers.group.send,
        peers.group_rank((peers.rank + 1) % peers.size),
        peers.tag,
        lay.sizes,
    )
    for j, i in enumerate(lay.gather_first):
        if not prepost:
            _forward_in_stream(peers, segs[i], targets[0][j], sends, received[0], j)
        elif sizes[i]:
            sends.append(send([segs[i]], nxt, tag))
    last = peers.size - 2
    for s, chunk in enumerate(lay.gather_steps):
        for j, i in enumerate(chunk):
            work = received[s][j]
            if work is not None:
                work.wait()
            if s == last:
                continue
            if not prepost:
                _forward_in_stream(peers, segs[i], targets[s + 1][j], sends, received[s + 1], j)
            elif sizes[i]:
                sends.append(send([segs[i]], nxt, tag))
    wait_all(sends)


def all_gather(peers: Peers, buf: torch.Tensor, bounds: list[int]) -> None:
    """In place on the flat `buf`: chunk `peers.rank` is valid before, every chunk after."""
    if peers.size > 1:
        lay = _layout_of(peers, buf, bounds)
        _gather(peers, buf.split_with_sizes(lay.sizes), lay, None, [])


def all_reduce(peers: Peers, buf: torch.Tensor, reduction: Reduction) -> None:
    """Ring all-reduce of the flat `buf` in place: reduce-scatter, then all-gather."""
    n, r = peers.size, peers.rank
    bounds = balanced_bounds(buf.numel(), n)
    if n == 1:
        reduction.finish(buf, 1)
        return
    lay = _layout_of(peers, buf, bounds)
    segs = buf.split_with_sizes(lay.sizes)
    # On gloo the all-gather's receives go up before the first send, so a neighbour that finishes
    # its reduce-scatter first finds them posted: a send that beats its receive waits a round trip
    # of gloo's ready-notifications (1.2-1.5x as fast at 1 MiB, ~1.05x from 4 MiB).
    # It is safe: the gather message into chunk c comes from c's owner once it has reduced c, which
    # needs our reduce-scatter send of c to have arrived; we never touch c in the reduce-scatter
    # after that send. For the same reason the all-gather need not wait for the reduce-scatter's
    # sends to complete: gloo has read a message out of buf once its receiver has it all.
    sends, gather = _reduce(peers, buf, segs, lay, reduction, peers.can_prepost(buf.device), post_gather=True)
    reduction.finish(buf[bounds[r] : bounds[r + 1]], n)
    _gather(peers, segs, lay, gather, sends)
