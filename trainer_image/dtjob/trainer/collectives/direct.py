"""Direct (pairwise-exchange) reduce-scatter and all-gather: every rank talks to every other at once.

Reduce-scatter: rank r sends chunk p straight to its owner p, for every p != r, and reduces the
n-1 copies of its own chunk as they arrive, always in the same order (from r-1, r-2, ..., r+1), so
a chunk's result depends only on the world size. All-gather: the owner sends its finished chunk
to every other rank. All-reduce is the two in a row. Per rank that is the ring's traffic exactly
- (n-1)/n of the vector out and in per phase - and the same 2(n-1) messages, but no message
waits for another: the ring forwards along n-1 dependent steps per phase, here each phase is one.

Why it pays: on a host where ranks outnumber cores, a ring step stalls whenever its
predecessor is not scheduled, and the stalls add up along the chain; direct was 1.1-1.5x as fast
as the ring at 1-4 MiB with 4 and 8 ranks on 2 cores, on par from 16 MiB (bench/README.md). Each
phase's n-1 messages still cost their per-message overhead, which the cost model (selection.py)
charges, measured. What it does not model: on a real network n-1 simultaneous flows into one
receiver are an incast, so for large groups across switches force the ring
(DTJOB_COLLECTIVE_ALGO=ring) until that is measured.

On gloo every receive of a call (the all-gather's too) is posted before the first send, so no send
waits for the receiver to get ready; a peer's reduce-scatter and all-gather messages share the
call's tag and gloo delivers them in order.
"""

from __future__ import annotations

import torch

from dtjob.trainer.collectives.peers import Peers, balanced_bounds, wait_all
from dtjob.trainer.collectives.reduce_ops import Reduction


def _others(peers: Peers) -> list[int]:
    """Other ranks, nearest predecessor first: r-1, r-2, ..., r+1 (also the reduction order)."""
    return [(peers.rank - i) % peers.size for i in range(1, peers.size)]


def _exchange_reduce(
    peers: Peers,
    buf: torch.Tensor,
    bounds: list[int],
    reduction: Reduction,
    gather_recvs: list[tuple[torch.Tensor, int]],
    out: torch.Tensor | None = None,
) -> list[torch.distributed.Work]:
    """The reduce-scatter, in place in buf or, with `out`, into `out` leaving buf as it is; also
    posts `gather_recvs` before any send. Returns their receive works."""
    n, r = peers.size, peers.rank
    mine = buf[bounds[r] : bounds[r + 1]]
    total = mine if out is None else out  # where our chunk's sum goes
    width = mine.numel()
    others = _others(peers)
    incoming = peers.scratch(0, (n - 1) * width, buf)
    areas = [incoming[i * width : (i + 1) * width] for i in range(n - 1)]
    # Sends go out nearest successor first (r+1, r+2, ...), the order in which each receiver
    # reduces what it gets (from its r-1 first).
    sends = [(buf[bounds[p] : bounds[p + 1]], p) for p in reversed(others)]
    recvs = list(zip(areas, others, strict=True))
    if peers.can_prepost(buf.device):
        _, reduce_works = peers.post(recvs=recvs)
        _, gather_works = peers.post(recvs=gather_recvs)
        send_works, _ = peers.post(sends=sends)
    else:  # NCCL: a phase's sends and receives go in one group; the gather's come later
        send_works, reduce_works = peers.post(sends=sends, recvs=recvs)
        gather_works = []
    one_each = len(reduce_works) == len(recvs)  # else a coalescing backend returned one for all
    if not one_each:
        wait_all(reduce_works)
    for i, area in enumerate(areas):  # reduce each as it lands
        if one_each:
            reduce_works[i].wait()
        reduction.combine_out(total if i else mine, area, total)
    reduction.finish(total, n)
    wait_all(send_works)
    return gather_works


def reduce_scatter(
    peers: Peers, src: torch.Tensor, out: torch.Tensor, bounds: list[int], reduction: Reduction
) -> None:
    """Reduce the flat `src`, left as it is, into `out`: chunk `peers.rank` of the result."""
    if peers.size == 1:
        out.copy_(src[bounds[0] : bounds[1]])
        reduction.finish(out, 1)
        return
    _exchange_reduce(peers, src, bounds, reduction, gather_recvs=[], out=out)


def _gather_recvs(peers: Peers, buf: torch.Tensor, bounds: list[int]) -> list[tuple[torch.Tensor, int]]:
    return [(buf[bounds[p] : bounds[p + 1]], p) for p in _others(peers)]


def _gather_sends(peers: Peers, buf: torch.Tensor, bounds: list[int]) -> list[tuple[torch.Tensor, int]]:
    r = peers.rank
    mine = buf[bounds[r] : bounds[r + 1]]
    return [(mine, p) for p in reversed(_others(peers))]


def all_gather(peers: Peers, buf: torch.Tensor, bounds: list[int]) -> None:
    """In place on the flat `buf`: chunk `peers.rank` is valid before, every chunk after."""
    if peers.size == 1:
        return
    sends, recvs = peers.post(
        sends=_gather_sends(peers, buf, bounds), recvs=_gather_recvs(peers, buf, bounds)
    )
    wait_all(recvs)
    wait_all(sends)


def all_reduce(peers: Peers, buf: torch.Tensor, reduction: Reduction) -> None:
    """Direct all-reduce of the flat `buf` in place: reduce-scatter, then all-gather."""
    bounds = balanced_bounds(buf.numel(), peers.size)
    # A peer's gather message can only arrive after it has reduced our contribution, i.e. after
    # our reduce-scatter send into that very chunk has left: posting its receive early is safe.
    early = peers.can_prepost(buf.device)
    gather_works = _exchange_reduce(
        peers, buf, bounds, reduction, gather_recvs=_gather_recvs(peers, buf, bounds) if early else []
    )
    if early:
        sends, _ = peers.post(sends=_gather_sends(peers, buf, bounds))
        wait_all(gather_works)
        wait_all(sends)
    else:
        all_gather(peers, buf, bounds)
