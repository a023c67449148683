"""Halving-doubling (Rabenseifner) reduce-scatter / all-gather / all-reduce, and recursive doubling.

Power-of-two groups: the reduce-scatter halves the range of blocks each step (partner = rank XOR
mask, mask = p/2 ... 1): keep one half, send the other, reduce what the partner sent for the kept
half. After log2(p) steps rank v owns block v. The all-gather doubles back (mask = 1 ... p/2).
That is 2*log2(p) messages instead of the ring's 2(p-1), for the same bytes.

Other world sizes: MPICH's reduce-to-the-nearest-power-of-two, not gloo's binary blocks. With
p = 2^floor(log2 n) and e = n - p "extra" ranks, ranks 2i and 2i+1 (i < e) fold together before
the power-of-two algorithm (2i hands its whole vector to 2i+1) and unfold after. Why this one:
it costs one extra full-vector step at each end, which only the cost model needs to know about
(auto then prefers the ring for large messages there); binary blocks save those bytes but need
uneven block exchanges between differently sized sub-groups, far more code for the world sizes
this project runs (<= 8, where the ring already wins on large messages). Folding also keeps one
owner per reduced block, so results stay bitwise identical on every rank.

Virtual ranks: v = i // 2 for the odd ranks i < 2e, v = i - e for ranks i >= 2e; even ranks below 2e
sit out. Virtual rank v covers the real ranks 2v, 2v+1 (v < e) or v + e, so its block is the
contiguous union of their chunks, which is what reduce-scatter and all-gather need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dtjob.trainer.collectives.peers import Peers, Works, balanced_bounds, segments_for, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction


class Fold:
    """The power-of-two layout of an n-rank group (MPICH's fold of the first 2e ranks)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.p = 1 << (n.bit_length() - 1)
        self.extra = n - self.p

    def virtual(self, rank: int) -> int | None:
        """Virtual rank, or None for an even rank below 2e that sits out."""
        if rank < 2 * self.extra:
            return rank // 2 if rank % 2 == 1 else None
        return rank - self.extra

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.extra else v + self.extra

    def first_real(self, v: int) -> int:
        return 2 * v if v < self.extra else v + self.extra

    def block_bounds(self, bounds: list[int]) -> list[int]:
        """Per-real-rank chunk offsets (n+1) -> per-virtual-rank block offsets (p+1)."""
        return [bounds[self.first_real(v)] for v in range(self.p)] + [bounds[self.n]]


@dataclass(frozen=True)
class _Exchange:
    """One step with `peer`, cut into segments (offsets into the call's vector): send `sends`,
    receive into `targets`. With `reduce_into` the targets are scratch offsets whose contents are
    reduced into those regions of the vector; without it they are the vector's own."""

    peer: int
    sends: tuple[tuple[int, int], ...]
    targets: tuple[tuple[int, int], ...]
    reduce_into: tuple[tuple[int, int], ...] | None = None


Phase = tuple[_Exchange, ...]


def _cut(lo: int, hi: int, k: int) -> tuple[tuple[int, int], ...]:
    b = balanced_bounds(hi - lo, k)
    return tuple((lo + b[j], lo + b[j + 1]) for j in range(k))


def _segments(
    send: tuple[int, int], recv: tuple[int, int], element_size: int, segment_bytes: int | None
) -> int:
    """Segments of one exchange: both ends count them from the larger of its two regions."""
    return segments_for(max(send[1] - send[0], recv[1] - recv[0]) * element_size, segment_bytes)


def halving(
    fold: Fold, vrank: int, vbounds: tuple[int, ...], element_size: int, segment_bytes: int | None
) -> tuple[Phase, int]:
    """Recursive halving among the virtual ranks, and the scratch it needs (elements): run with a
    reduction, it leaves block `vrank` holding the result."""
    steps = []
    lo, hi = 0, fold.p
    mask = fold.p // 2
    offset = 0  # each step receives into its own scratch area (sizes halve: all fit in one vector)
    while mask >= 1:
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if vrank & mask else ((lo, mid), (mid, hi))
        send = (vbounds[give[0]], vbounds[give[1]])
        recv = (vbounds[keep[0]], vbounds[keep[1]])
        size = recv[1] - recv[0]
        k = _segments(send, recv, element_size, segment_bytes)
        targets = _cut(offset, offset + size, k)
        steps.append(_Exchange(fold.real(vrank ^ mask), _cut(*send, k), targets, _cut(*recv, k)))
        offset += size
        lo, hi = keep
        mask //= 2
    return tuple(steps), offset


def doubling(
    fold: Fold, vrank: int, vbounds: tuple[int, ...], element_size: int, segment_bytes: int | None
) -> Phase:
    """Recursive doubling among the virtual ranks: block `vrank` valid before, every block after."""
    steps = []
    mask = 1
    while mask < fold.p:
        partner = vrank ^ mask
        mine = (vrank // mask) * mask
        theirs = (partner // mask) * mask
        send = (vbounds[mine], vbounds[mine + mask])
        recv = (vbounds[theirs], vbounds[theirs + mask])
        k = _segments(send, recv, element_size, segment_bytes)
        steps.append(_Exchange(fold.real(partner), _cut(*send, k), _cut(*recv, k)))
        mask *= 2
    return tuple(steps)


@functools.lru_cache(maxsize=256)
def _plan(
    vbounds: tuple[int, ...], n: int, rank: int, element_size: int, segment_bytes: int | None
) -> tuple[Phase, int, Phase]:
    """The halving phase, its scratch size and the doubling phase of rank `rank` of n, for the
    virtual ranks' block offsets `vbounds`. Made once per layout: working the offsets out on every
    call cost ~300 interpreter calls per 4-rank all-reduce, on the critical path (see ring._Layout)."""
    fold = Fold(n)
    vrank = fold.virtual(rank)
    assert vrank is not None, "ranks that sit out take no part in the power-of-two phases"
    halves, scratch = halving(fold, vrank, vbounds, element_size, segment_bytes)
    return halves, scratch, doubling(fold, vrank, vbounds, element_size, segment_bytes)


def _plan_of(peers: Peers, buf: torch.Tensor, vbounds: list[int]) -> tuple[Phase, int, Phase]:
    return _plan(tuple(vbounds), peers.size, peers.rank, buf.element_size(), peers.segment_bytes)


def _run(
    peers: Peers,
    buf: torch.Tensor,
    phases: list[Phase],
    reduction: Reduction | None = None,
    scratch_size: int = 0,
    then: Callable[[], None] = lambda: None,
) -> None:
    """Run the phases' exchanges in order, segment by segment; `then` runs after the first phase.

    Exchanges with `reduce_into` receive into scratch and reduce with `reduction`. Both ends cut
    their send and receive regions into the same number of segments, so segment j of one side's
    send is segment j of the other's receive; segment j is reduced while segment j+1 is still in
    flight. On gloo every receive of every phase is posted before the first send (each step has
    its own target area), so no send waits for its receiver to catch up. For the all-reduce that
    includes the all-gather's receives, which is safe: the partner of a doubling step sends back
    the very blocks we gave it in the halving step of the same mask, and only after it received
    them; we never touch those blocks again in between. (~1.2x as fast at 64 KiB - 1 MiB as
    posting them when the all-gather starts.)
    """
    scratch = peers.scratch(0, scratch_size, buf) if scratch_size else buf

    def target(ex: _Exchange, lo: int, hi: int) -> torch.Tensor:
        return (buf if ex.reduce_into is None else scratch)[lo:hi]

    exchanges = [ex for phase in phases for ex in phase]
    prepost = peers.can_prepost(buf.device)
    recvs: dict[tuple[int, int], Works] = {}
    if prepost:
        for t, ex in enumerate(exchanges):
            for j, (lo, hi) in enumerate(ex.targets):
                recvs[t, j] = peers.recv(target(ex, lo, hi), ex.peer)
    sends: Works = []
    t = 0
    for number, phase in enumerate(phases):
        for ex in phase:
            for j, (lo, hi) in enumerate(ex.sends):
                if prepost:
                    sends += peers.send(buf[lo:hi], ex.peer)
                    continue
                own = [(target(ex, *ex.targets[j]), ex.peer)]
                sw, recvs[t, j] = peers.post(sends=[(buf[lo:hi], ex.peer)], recvs=own)
                sends += sw
            for j, (lo, hi) in enumerate(ex.targets):
                wait_all(recvs.pop((t, j)))
                if ex.reduce_into is not None:
                    assert reduction is not None
                    a, b = ex.reduce_into[j]
                    reduction.combine(buf[a:b], scratch[lo:hi])
            t += 1
        if number == 0:
            then()
    wait_all(sends)


def _fold_in(peers: Peers, fold: Fold, buf: torch.Tensor, reduction: Reduction) -> int | None:
    """Ranks 2i hand their whole vector to 2i+1 (i < e), which reduces it in. Returns the vrank."""
    r = peers.rank
    vrank = fold.virtual(r)
    if r < 2 * fold.extra:
        if vrank is None:
            b = _segment_bounds(peers, buf)
            wait_all(
                [w for j in range(len(b) - 1) for w in peers.post(sends=[(buf[b[j] : b[j + 1]], r + 1)])[0]]
            )
        else:
            _recv_reduce(peers, r - 1, buf, reduction)
    return vrank


def _segment_bounds(peers: Peers, buf: torch.Tensor) -> list[int]:
    return balanced_bounds(buf.numel(), peers.segments(buf.numel(), buf.element_size()))


def _recv_reduce(peers: Peers, peer: int, buf: torch.Tensor, reduction: Reduction) -> None:
    """Receive the partner's whole vector segment by segment (as _fold_in sends it), reducing as it comes."""
    scratch = peers.scratch(1, buf.numel(), buf)
    b = _segment_bounds(peers, buf)
    recvs = [peers.post(recvs=[(scratch[b[j] : b[j + 1]], peer)])[1] for j in range(len(b) - 1)]
    for j, works in enumerate(recvs):
        wait_all(works)
        reduction.combine(buf[b[j] : b[j + 1]], scratch[b[j] : b[j + 1]])


def _unfold(peers: Peers, fold: Fold, region: tuple[int, int] | None, buf: torch.Tensor) -> None:
    """Ranks 2i+1 hand the finished `region` of buf (everything if None) back to 2i (i < e)."""
    r = peers.rank
    if r >= 2 * fold.extra:
        return
    view = buf if region is None else buf[region[0] : region[1]]
    if r % 2 == 1:
        sw, _ = peers.post(sends=[(view, r - 1)])
        wait_all(sw)
    else:
        _, rw = peers.post(recvs=[(view, r + 1)])
        wait_all(rw)


def reduce_scatter(
    peers: Peers, src: torch.Tensor, out: torch.Tensor, bounds: list[int], reduction: Reduction
) -> None:
    """Reduce the flat `src`, left as it is, into `out`: chunk `peers.rank` of the result.

    Halving sends partial sums on from the region it reduced in place, so this works on a copy.
    """
    work = peers.scratch(2, src.numel(), src)
    work.copy_(src)
    _reduce_scatter_in_place(peers, work, bounds, reduction)
    out.copy_(work[bounds[peers.rank] : bounds[peers.rank + 1]])


def _reduce_scatter_in_place(
    peers: Peers, buf: torch.Tensor, bounds: list[int], reduction: Reduction
) -> None:
    """In place on the flat `buf`: afterwards chunk `peers.rank` holds the finished reduction."""
    fold = Fold(peers.size)
    vrank = _fold_in(peers, fold, buf, reduction)
    if vrank is not None:
        vbounds = fold.block_bounds(bounds)
        halves, scratch_size, _ = _plan_of(peers, buf, vbounds)
        _run(peers, buf, [halves], reduction, scratch_size)
        reduction.finish(buf[vbounds[vrank] : vbounds[vrank + 1]], peers.size)
    # An odd rank 2i+1 (i < e) owns chunks 2i and 2i+1; chunk 2i goes back to rank 2i.
    mate = peers.rank - 1 if peers.rank % 2 == 1 else peers.rank
    _unfold(peers, fold, (bounds[mate], bounds[mate + 1]), buf)


def all_gather(peers: Peers, buf: torch.Tensor, bounds: list[int]) -> None:
    """In place on the flat `buf`: chunk `peers.rank` valid before, every chunk after."""
    fold = Fold(peers.size)
    r = peers.rank
    vrank = fold.virtual(r)
    if r < 2 * fold.extra:  # 2i hands its chunk to 2i+1, which then speaks for both
        mate = r - (r % 2)
        chunk = buf[bounds[mate] : bounds[mate + 1]]
        if vrank is None:
            wait_all(peers.post(sends=[(chunk, r + 1)])[0])
        else:
            wait_all(peers.post(recvs=[(chunk, r - 1)])[1])
    if vrank is not None:
        _run(peers, buf, [_plan_of(peers, buf, fold.block_bounds(bounds))[2]])
    _unfold(peers, fold, None, buf)


def all_reduce(peers: Peers, buf: torch.Tensor, reduction: Reduction) -> None:
    """Rabenseifner all-reduce of the flat `buf` in place."""
    fold = Fold(peers.size)
    vrank = _fold_in(peers, fold, buf, reduction)
    if vrank is not None:
        vbounds = balanced_bounds(buf.numel(), fold.p)
        halves, scratch_size, doubles = _plan_of(peers, buf, vbounds)
        mine = buf[vbounds[vrank] : vbounds[vrank + 1]]
        finish = functools.partial(reduction.finish, mine, peers.size)
        _run(peers, buf, [halves, doubles], reduction, scratch_size, finish)
    _unfold(peers, fold, None, buf)


def recursive_doubling_all_reduce(peers: Peers, buf: torch.Tensor, reduction: Reduction) -> None:
    """Latency-optimal all-reduce for small messages: log2(p) full-vector swaps.

    Both partners compute `lower OP upper` with the operands in that order, so every rank of a
    pair holds the same bits after each step (this matters for NaN payloads and MAX/MIN of
    signed zeros, where the operand order can show).
    """
    fold = Fold(peers.size)
    vrank = _fold_in(peers, fold, buf, reduction)
    if vrank is not None:
        partners = []
        mask = 1
        while mask < fold.p:
            partners.append(vrank ^ mask)
            mask *= 2
        numel = buf.numel()
        incoming = peers.scratch(0, len(partners) * numel, buf)  # one area per step: all preposted
        prepost = peers.can_prepost(buf.device)
        recvs = {}
        if prepost:
            for t, partner in enumerate(partners):
                recvs[t] = peers.post(recvs=[(incoming[t * numel : (t + 1) * numel], fold.real(partner))])[1]
        for t, partner in enumerate(partners):
            area = incoming[t * numel : (t + 1) * numel]
            sw, rw = peers.post(
                sends=[(buf, fold.real(partner))], recvs=[] if prepost else [(area, fold.real(partner))]
            )
            wait_all(recvs.pop(t) if prepost else rw)
            wait_all(sw)  # buf is overwritten next: the send must have left
            if vrank < partner:
                reduction.combine(buf, area)
            else:
                reduction.combine_into_second(area, buf)
        reduction.finish(buf, peers.size)
    _unfold(peers, fold, None, buf)
