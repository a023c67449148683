"""Broadcast: a binomial tree for small messages, scatter + all-gather for large ones.

- `tree`: MPICH's binomial tree over ranks relative to the root: ceil(log2 n) rounds, each
  forwarding the whole message. Cheapest in latency, but the root sends the full message
  log2(n) times.
- `ring`: the root scatters one chunk to each rank, then a ring all-gather: every link carries
  ~2(n-1)/n of the message once, so bandwidth no longer depends on log2(n) (van de Geijn).
- `hd`: the same scatter followed by the recursive-doubling all-gather: fewer rounds than the
  ring, same bytes for power-of-two groups.
"""

from __future__ import annotations

import torch

from dtjob.trainer.collectives import halving_doubling, ring
from dtjob.trainer.collectives.peers import Peers, balanced_bounds, wait_all


def tree(peers: Peers, buf: torch.Tensor, root: int) -> None:
    n, r = peers.size, peers.rank
    relative = (r - root) % n
    mask = 1
    while mask < n:
        if relative & mask:
            wait_all(peers.post(recvs=[(buf, (r - mask) % n)])[1])
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if relative + mask < n:
            sends += peers.post(sends=[(buf, (r + mask) % n)])[0]
        mask >>= 1
    wait_all(sends)


def _scatter(peers: Peers, buf: torch.Tensor, root: int, bounds: list[int]) -> None:
    if peers.rank == root:
        sends = []
        for peer in range(peers.size):
            if peer != root:
                sends += peers.post(sends=[(buf[bounds[peer] : bounds[peer + 1]], peer)])[0]
        wait_all(sends)
    else:
        wait_all(peers.post(recvs=[(buf[bounds[peers.rank] : bounds[peers.rank + 1]], root)])[1])


def scatter_ring(peers: Peers, buf: torch.Tensor, root: int) -> None:
    bounds = balanced_bounds(buf.numel(), peers.size)
    _scatter(peers, buf, root, bounds)
    ring.all_gather(peers, buf, bounds)


def scatter_doubling(peers: Peers, buf: torch.Tensor, root: int) -> None:
    bounds = balanced_bounds(buf.numel(), peers.size)
    _scatter(peers, buf, root, bounds)
    halving_doubling.all_gather(peers, buf, bounds)
