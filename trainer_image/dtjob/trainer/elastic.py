"""Joining the gang: rendezvous at rank 0's store, the generation check, and the stop agreement.

Rank 0 hosts a `TCPStore` at MASTER_ADDR:MASTER_PORT (under torchrun, whose agent already hosts
one, every rank is a client). Before the process group is created, rank 0 publishes its
DTJOB_GENERATION in the store and every other rank compares its own with it: a worker left over
from an earlier generation (or one that reached a newer gang's master) stops there with
`StaleGenerationError`, before it can register as a member. The process group itself lives under
a per-generation key prefix, and an all-gather of (generation, world size) right after it is
created checks the whole gang once more.

Timeouts: reaching the master and waiting for the whole gang may take `--rendezvous-timeout`
(pods start at different times, DNS names appear late); every collective afterwards fails after
`--collective-timeout`, so a lost peer makes the survivors exit non-zero instead of hanging.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dtjob.trainer.config import TrainerConfig

_GENERATION_KEY = "dtjob/generation"
_RESOLVE_RETRY_SECONDS = 0.5


class RendezvousError(Exception):
    """The master cannot be reached, or its port cannot be bound (a configuration problem)."""


class StaleGenerationError(Exception):
    """This worker and the gang it reached belong to different generations."""


def _resolve_until(host: str, deadline: float) -> None:
    """Wait for `host` to resolve: a pod's DNS name may appear after its peers start."""
    while True:
        try:
            socket.getaddrinfo(host, None)
            return
        except socket.gaierror as err:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"cannot resolve MASTER_ADDR={host!r}: {err}; check --master-addr (env MASTER_ADDR)"
                ) from None
            time.sleep(_RESOLVE_RETRY_SECONDS)


def _connect_store(c: TrainerConfig) -> dist.TCPStore:
    deadline = time.monotonic() + c.rendezvous_timeout
    _resolve_until(c.master_addr, deadline)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = c.rank == 0 and not agent_hosts_store
    remaining = max(1.0, deadline - time.monotonic())
    try:
        return dist.TCPStore(
            c.master_addr,
            c.master_port,
            c.world_size,
            is_master=is_master,
            timeout=timedelta(seconds=remaining),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if is_master:
            raise RendezvousError(
                f"rank 0 cannot listen on MASTER_PORT={c.master_port} (--master-port): {first_line}"
            ) from None
        raise RendezvousError(
            f"cannot reach the master at {c.master_addr}:{c.master_port} within {c.rendezvous_timeout:g}s "
            f"(MASTER_ADDR/MASTER_PORT, --rendezvous-timeout): {first_line}"
        ) from None


def _check_generation(store: dist.Store, c: TrainerConfig) -> None:
    if c.rank == 0:
        store.set(_GENERATION_KEY, str(c.generation))
        return
    try:
        theirs = int(store.get(_GENERATION_KEY).decode())
    except (RuntimeError, ValueError) as err:
        raise RendezvousError(
            f"rank 0 at {c.master_addr}:{c.master_port} never published its generation within "
            f"{c.rendezvous_timeout:g}s (--rendezvous-timeout): {err}"
        ) from None
    if theirs != c.generation:
        raise StaleGenerationError(
            f"generation mismatch: this worker is DTJOB_GENERATION={c.generation} but the gang at "
            f"{c.master_addr}:{c.master_port} is generation {theirs}; refusing to join"
        )


def init_process_group(c: TrainerConfig) -> None:
    """Create the default gloo process group for this gang, or a one-process group."""
    pg_timeout = timedelta(seconds=c.collective_timeout)
    if c.world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout)
        return
    store = _connect_store(c)
    _check_generation(store, c)
    gang_store = dist.PrefixStore(f"dtjob/g{c.generation}/ws{c.world_size}", store)
    dist.init_process_group(
        "gloo", store=gang_store, rank=c.rank, world_size=c.world_size, timeout=pg_timeout
    )
    mine = torch.tensor([c.generation, c.world_size], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(c.world_size)]
    dist.all_gather(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if not torch.equal(theirs, mine):
            raise StaleGenerationError(
                f"rank {rank} is generation {int(theirs[0])} with WORLD_SIZE={int(theirs[1])}, this worker "
                f"generation {c.generation} with WORLD_SIZE={c.world_size}; refusing to train"
            )


def agree(flag: bool) -> bool:
    """True on every rank if it is True on any rank (one tiny all-reduce, MAX)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
