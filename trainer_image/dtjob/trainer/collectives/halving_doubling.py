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

from dtjob.trainer.collectives.comm import Comm, balanced_bounds, wait_all
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


class _Step:
    """One exchange with `peer`: send `send`, receive into `target` (reduced into `recv` if a scratch)."""

    def __init__(self, peer: int, send: torch.Tensor, recv: torch.Tensor, target: torch.Tensor) -> None:
        self.peer, self.send, self.recv, self.target = peer, send, recv, target


@dataclass
class _Phase:
    """Exchanges that run in order, reducing what arrives with `reduction` (None: just receive);
    `then` runs when the phase is done (the all-reduce finishes its block there, e.g. AVG's divide)."""

    steps: list[_Step]
    reduction: Reduction | None = None
    then: Callable[[], None] = lambda: None


def _run(comm: Comm, phases: list[_Phase]) -> None:
    """Run the phases' exchanges in order, segment by segment, reducing where a phase says so.

    Both ends cut their send and receive regions into the same number of segments, so segment j of
    one side's send is segment j of the other's receive; segment j is reduced while segment j+1 is
    still in flight. On gloo every receive of every phase is posted before the first send (each
    step has its own target area), so no send waits for its receiver to catch up. For the
    all-reduce that includes the all-gather's receives, which is safe: the partner of a doubling
    step sends back the very blocks we gave it in the halving step of the same mask, and only
    after it received them; we never touch those blocks again in between. Measured (4 ranks, one
    run paired with the all-reduce that posted them at the all-gather's start): 1.26x as fast at
    64 KiB, 1.21x at 1 MiB, on par at 4 MiB, 1.03x at 16 MiB.
    """
    steps = [step for phase in phases for step in phase.steps]
    prepost = bool(steps) and comm.can_prepost(steps[0].send.device)
    plans = []
    for step in steps:
        k = comm.segments(max(step.send.numel(), step.recv.numel()), step.send.element_size())
        plans.append((balanced_bounds(step.send.numel(), k), balanced_bounds(step.recv.numel(), k)))
    recvs: dict[tuple[int, int], list[torch.distributed.Work]] = {}
    if prepost:
        for t, (step, (_, r_b)) in enumerate(zip(steps, plans, strict=True)):
            for j in range(len(r_b) - 1):
                recvs[t, j] = comm.post(recvs=[(step.target[r_b[j] : r_b[j + 1]], step.peer)])[1]
    sends: list[torch.distributed.Work] = []
    t = 0
    for phase in phases:
        for step in phase.steps:
            s_b, r_b = plans[t]
            for j in range(len(s_b) - 1):
                own = [] if prepost else [(step.target[r_b[j] : r_b[j + 1]], step.peer)]
                sw, rw = comm.post(sends=[(step.send[s_b[j] : s_b[j + 1]], step.peer)], recvs=own)
                sends += sw
                if not prepost:
                    recvs[t, j] = rw
            for j in range(len(r_b) - 1):
                wait_all(recvs.pop((t, j)))
                if phase.reduction is not None:
                    phase.reduction.combine(step.recv[r_b[j] : r_b[j + 1]], step.target[r_b[j] : r_b[j + 1]])
            t += 1
        phase.then()
    wait_all(sends)


def halving_steps(comm: Comm, fold: Fold, vrank: int, buf: torch.Tensor, vbounds: list[int]) -> list[_Step]:
    """The exchanges of recursive halving among the virtual ranks: run with the reduction, they
    leave block `vrank` holding it."""
    regions = []
    lo, hi = 0, fold.p
    mask = fold.p // 2
    while mask >= 1:
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if vrank & mask else ((lo, mid), (mid, hi))
        regions.append((fold.real(vrank ^ mask), give, keep))
        lo, hi = keep
        mask //= 2
    # Each step receives into its own scratch area (sizes halve: all of them fit in one vector).
    sizes = [vbounds[keep[1]] - vbounds[keep[0]] for _, _, keep in regions]
    scratch = comm.scratch(0, sum(sizes), buf)
    steps, offset = [], 0
    for (peer, give, keep), size in zip(regions, sizes, strict=True):
        steps.append(
            _Step(
                peer,
                buf[vbounds[give[0]] : vbounds[give[1]]],
                buf[vbounds[keep[0]] : vbounds[keep[1]]],
                scratch[offset : offset + size],
            )
        )
        offset += size
    return steps


def doubling_steps(fold: Fold, vrank: int, buf: torch.Tensor, vbounds: list[int]) -> list[_Step]:
    """The exchanges of recursive doubling among the virtual ranks: block `vrank` valid before they
    run, every block after."""
    steps = []
    mask = 1
    while mask < fold.p:
        partner = vrank ^ mask
        mine = (vrank // mask) * mask
        theirs = (partner // mask) * mask
        recv = buf[vbounds[theirs] : vbounds[theirs + mask]]
        steps.append(_Step(fold.real(partner), buf[vbounds[mine] : vbounds[mine + mask]], recv, recv))
        mask *= 2
    return steps


def _fold_in(comm: Comm, fold: Fold, buf: torch.Tensor, reduction: Reduction) -> int | None:
    """Ranks 2i hand their whole vector to 2i+1 (i < e), which reduces it in. Returns the vrank."""
    r = comm.rank
    vrank = fold.virtual(r)
    if r < 2 * fold.extra:
        if vrank is None:
            b = _segment_bounds(comm, buf)
            wait_all(
                [w for j in range(len(b) - 1) for w in comm.post(sends=[(buf[b[j] : b[j + 1]], r + 1)])[0]]
            )
        else:
            _recv_reduce(comm, r - 1, buf, reduction)
    return vrank


def _segment_bounds(comm: Comm, buf: torch.Tensor) -> list[int]:
    return balanced_bounds(buf.numel(), comm.segments(buf.numel(), buf.element_size()))


def _recv_reduce(comm: Comm, peer: int, buf: torch.Tensor, reduction: Reduction) -> None:
    """Receive the partner's whole vector segment by segment (as _fold_in sends it), reducing as it comes."""
    scratch = comm.scratch(1, buf.numel(), buf)
    b = _segment_bounds(comm, buf)
    recvs = [comm.post(recvs=[(scratch[b[j] : b[j + 1]], peer)])[1] for j in range(len(b) - 1)]
    for j, works in enumerate(recvs):
        wait_all(works)
        reduction.combine(buf[b[j] : b[j + 1]], scratch[b[j] : b[j + 1]])


def _unfold(comm: Comm, fold: Fold, region: tuple[int, int] | None, buf: torch.Tensor) -> None:
    """Ranks 2i+1 hand the finished `region` of buf (everything if None) back to 2i (i < e)."""
    r = comm.rank
    if r >= 2 * fold.extra:
        return
    view = buf if region is None else buf[region[0] : region[1]]
    if r % 2 == 1:
        sw, _ = comm.post(sends=[(view, r - 1)])
        wait_all(sw)
    else:
        _, rw = comm.post(recvs=[(view, r + 1)])
        wait_all(rw)


def reduce_scatter(comm: Comm, buf: torch.Tensor, bounds: list[int], reduction: Reduction) -> None:
    """In place on the flat `buf`: afterwards chunk `comm.rank` holds the finished reduction."""
    fold = Fold(comm.size)
    vrank = _fold_in(comm, fold, buf, reduction)
    if vrank is not None:
        vbounds = fold.block_bounds(bounds)
        _run(comm, [_Phase(halving_steps(comm, fold, vrank, buf, vbounds), reduction)])
        reduction.finish(buf[vbounds[vrank] : vbounds[vrank + 1]], comm.size)
    # An odd rank 2i+1 (i < e) owns chunks 2i and 2i+1; chunk 2i goes back to rank 2i.
    mate = comm.rank - 1 if comm.rank % 2 == 1 else comm.rank
    _unfold(comm, fold, (bounds[mate], bounds[mate + 1]), buf)


def all_gather(comm: Comm, buf: torch.Tensor, bounds: list[int]) -> None:
    """In place on the flat `buf`: chunk `comm.rank` valid before, every chunk after."""
    fold = Fold(comm.size)
    r = comm.rank
    vrank = fold.virtual(r)
    if r < 2 * fold.extra:  # 2i hands its chunk to 2i+1, which then speaks for both
        mate = r - (r % 2)
        chunk = buf[bounds[mate] : bounds[mate + 1]]
        if vrank is None:
            wait_all(comm.post(sends=[(chunk, r + 1)])[0])
        else:
            wait_all(comm.post(recvs=[(chunk, r - 1)])[1])
    if vrank is not None:
        _run(comm, [_Phase(doubling_steps(fold, vrank, buf, fold.block_bounds(bounds)))])
    _unfold(comm, fold, None, buf)


def all_reduce(comm: Comm, buf: torch.Tensor, reduction: Reduction) -> None:
    """Rabenseifner all-reduce of the flat `buf` in place."""
    fold = Fold(comm.size)
    vrank = _fold_in(comm, fold, buf, reduction)
    if vrank is not None:
        vbounds = balanced_bounds(buf.numel(), fold.p)
        mine = buf[vbounds[vrank] : vbounds[vrank + 1]]
        finish = functools.partial(reduction.finish, mine, comm.size)
        halving = _Phase(halving_steps(comm, fold, vrank, buf, vbounds), reduction, finish)
        _run(comm, [halving, _Phase(doubling_steps(fold, vrank, buf, vbounds))])
    _unfold(comm, fold, None, buf)


def recursive_doubling_all_reduce(comm: Comm, buf: torch.Tensor, reduction: Reduction) -> None:
    """Latency-optimal all-reduce for small messages: log2(p) full-vector swaps.

    Both partners compute `lower OP upper` with the operands in that order, so every rank of a
    pair holds the same bits after each step (this matters for NaN payloads and MAX/MIN of
    signed zeros, where the operand order can show).
    """
    fold = Fold(comm.size)
    vrank = _fold_in(comm, fold, buf, reduction)
    if vrank is not None:
        partners = []
        mask = 1
        while mask < fold.p:
            partners.append(vrank ^ mask)
            mask *= 2
        numel = buf.numel()
        incoming = comm.scratch(0, len(partners) * numel, buf)  # one area per step: all preposted
        prepost = comm.can_prepost(buf.device)
        recvs = {}
        if prepost:
            for t, partner in enumerate(partners):
                recvs[t] = comm.post(recvs=[(incoming[t * numel : (t + 1) * numel], fold.real(partner))])[1]
        for t, partner in enumerate(partners):
            area = incoming[t * numel : (t + 1) * numel]
            sw, rw = comm.post(
                sends=[(buf, fold.real(partner))], recvs=[] if prepost else [(area, fold.real(partner))]
            )
            wait_all(recvs.pop(t) if prepost else rw)
            wait_all(sw)  # buf is overwritten next: the send must have left
            if vrank < partner:
                reduction.combine(buf, area)
            else:
                reduction.combine_into_second(area, buf)
        reduction.finish(buf, comm.size)
    _unfold(comm, fold, None, buf)
