"""Joining the gang: rendezvous at rank 0's store, the generation check, and the stop agreement.

Rank 0 hosts a `TCPStore` at MASTER_ADDR:MASTER_PORT (under torchrun, whose agent already hosts
one, every rank is a client). Before the process group is created, rank 0 publishes its
DTJOB_GENERATION in the store and every other rank compares its own with it: a worker left over
from an earlier generation (or one that reached a newer gang's master) stops there with
`StaleGenerationError`, before it can register as a member. The process group itself lives under
a per-generation key prefix, and an all-gather of (generation, world size) right after it is
created checks the whole gang once more.

Timeouts: reaching the master and waiting for the whole gang may take `rendezvous_timeout`
(pods start at different times, DNS names appear late); every collective afterwards fails after
`collective_timeout`, so a lost peer makes the survivors exit non-zero instead of hanging.

On CUDA the default group is NCCL (tensors) and a gloo group over the same ranks sits beside it
(`parallel.comm.control_group`) for what the runtime agrees on in CPU memory: stop requests,
checkpoint indexes, Python objects.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dtjob import contract
from dtjob.trainer.parallel.comm import control_group

log = logging.getLogger("dtjob.trainer")

_GENERATION_KEY = "dtjob/generation"
# How often a starting worker asks DNS for its master's name (a query each time: 2,000 a second
# from a 1,024-worker gang waiting for rank 0's record).
_RESOLVE_RETRY_SECONDS = 0.5
# How often it tries the master's port. torch's TCPStore client retries a refused connection only
# every 1 s (c10d's FixedBackoff): a worker that starts before rank 0 listens loses 0.5 s on
# average in every restart, two thirds of a 0.76 s connect. A refused connect costs the
# master's kernel one RST: 20,000 a second from 1,023 workers for the moment before it listens.
_PORT_RETRY_SECONDS = 0.05
# One connect attempt's limit: a SYN lost while the pod's network comes up is sent again by the
# kernel only after 1 s; a new attempt goes sooner (an answer on the pod network takes < 1 ms).
_CONNECT_ATTEMPT_SECONDS = 0.25
# A worker still waiting for its master says so this often, with the address its name resolves to
# (a stale name shows), so a gang stuck in its rendezvous is readable from the pods' logs long
# before the rendezvous timeout (300 s) ends it.
_WAIT_REPORT_SECONDS = 10.0


@dataclass(frozen=True)
class Gang:
    """Who this process is in its gang, as the operator's (and torchrun's) environment says."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    generation: int = 0
    rendezvous_timeout: float = 300.0
    collective_timeout: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Gang:
        try:
            env = contract.PodEnv.from_environ(os.environ if environ is None else environ)
        except contract.PodEnvError as err:
            raise RendezvousError(str(err)) from None
        values: dict[str, object] = {
            "rank": env.rank,
            "world_size": env.world_size,
            "local_rank": env.local_rank,
            "local_world_size": env.local_world_size,
            "master_addr": env.master_addr,
            "master_port": env.master_port,
            "generation": env.generation,
        }
        values.update(overrides)
        gang = cls(**values)  # type: ignore[arg-type]
        if not 0 <= gang.rank < gang.world_size:
            raise RendezvousError(f"RANK={gang.rank} must be in [0, WORLD_SIZE={gang.world_size})")
        return gang


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


def _wait_for_port(host: str, port: int, deadline: float) -> None:
    """Wait until something listens at host:port (the master's store), or the deadline passes
    (the store client's own connect then reports the error)."""
    started = reported = time.monotonic()
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=_CONNECT_ATTEMPT_SECONDS):
                return
        except OSError as err:
            now = time.monotonic()
            if now - reported >= _WAIT_REPORT_SECONDS:
                reported = now
                log.warning(
                    "waiting %.0fs for the master's store at %s:%d (%s): %s",
                    now - started,
                    host,
                    port,
                    _address_of(host),
                    err,
                )
            time.sleep(_PORT_RETRY_SECONDS)


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as err:
        return f"not resolved: {err}"


def _connect_store(c: Gang) -> dist.TCPStore:
    deadline = time.monotonic() + c.rendezvous_timeout
    _resolve_until(c.master_addr, deadline)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = c.rank == 0 and not agent_hosts_store
    if not is_master:
        _wait_for_port(c.master_addr, c.master_port, deadline)
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


def _check_generation(store: dist.Store, c: Gang) -> None:
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


def gang_prefix(c: Gang) -> str:
    """The store prefix of this generation's gang (its process group, its heartbeats)."""
    return f"dtjob/g{c.generation}/ws{c.world_size}"


def gang_token() -> str:
    """A token every rank of the gang just formed shares and no earlier gang had: rank 0 draws it,
    the control group broadcasts it. Keys a gang keeps in the store after it formed go under it:
    under torchrun every rank is a client of the agent's store, which outlives the gangs it serves,
    and a restart round at the same world size has the same gang_prefix, so an earlier gang's
    heartbeat verdict ("rank 1 lost") would otherwise end every later gang within a second."""
    token = [secrets.token_hex(8) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(token, src=0, group=control_group())
    return str(token[0])


def init_process_group(c: Gang, backend: str = "gloo") -> dist.Store | None:
    """Create the default process group for this gang (a one-process group at world size 1), and
    the gloo group beside an NCCL one; returns the rendezvous store (None at world size 1)."""
    pg_timeout = timedelta(seconds=c.collective_timeout)
    if c.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=pg_timeout)
        control_group()
        return None
    store = _connect_store(c)
    _check_generation(store, c)
    gang_store = dist.PrefixStore(gang_prefix(c), store)
    dist.init_process_group(
        backend, store=gang_store, rank=c.rank, world_size=c.world_size, timeout=pg_timeout
    )
    group = control_group()
    mine = torch.tensor([c.generation, c.world_size], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(c.world_size)]
    dist.all_gather(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if not torch.equal(theirs, mine):
            raise StaleGenerationError(
                f"rank {rank} is generation {int(theirs[0])} with WORLD_SIZE={int(theirs[1])}, this worker "
                f"generation {c.generation} with WORLD_SIZE={c.world_size}; refusing to train"
            )
    return store


def agree(flag: bool) -> bool:
    """True on every rank if it is True on any rank (one tiny all-reduce, MAX, on the CPU)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return bool(t.item())
