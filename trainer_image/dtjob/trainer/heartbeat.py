"""The gang watches itself: a rank that goes silent is found in seconds, not at the collective timeout.

Every rank runs a daemon thread with its own connection to the rendezvous store (rank 0's
TCPStore, or torchrun's agent store). Every beat (contract.Liveness: an eighth of the timeout, at
most a second) it
counts its own beat up and reads the beat of the next rank (rank + 1 mod world), three
non-blocking store operations per rank and beat, so a gang of 1,024 ranks at the default 10 s
timeout costs the store about 3,000 small operations a second. A rank whose beat has not moved
for `timeout` seconds (on the watcher's own clock: no clock skew between hosts matters), or a
store that has not answered for that long (rank 0 itself lost, or this pod cut off the
network), is lost, found at most a beat after the timeout (a beat seen late) plus the time a
round takes: the watcher names it in the store, every rank sees the name within a
second, logs the contract's peer-lost line and exits EXIT_PEER_LOST, so the operator restarts the
gang at once instead of the survivors waiting in a collective for `collective_timeout`.

A hung process (SIGSTOP, a deadlock holding the interpreter lock) stops its own heartbeat thread
too; a process blocked in a collective keeps beating (it is alive; the peer it waits for is not).
A collective that fails because a peer is gone ("Connection closed by peer": its process or its
node died) would end this rank with a plain error, and the operator would not learn which rank
is gone (a pod on a dead node looks Running until the node turns NotReady, 15-40 s later):
`await_verdict` holds the error until the heartbeat names the silent rank, within the timeout.
A rank that finishes (the last step done, or a planned stop) says so first, and its watcher stops
watching, so a gang that ends is never taken for a lost one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dtjob import contract
from dtjob.trainer.collectives.abort import is_peer_failure

__all__ = ["Heartbeat", "is_peer_failure", "leave_failed", "start"]

log = logging.getLogger("dtjob.trainer")


class _Calls:
    """Runs calls one after the other on a daemon thread (a stuck one must not keep the
    process from exiting, which a ThreadPoolExecutor's worker would)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._serve, name="dtjob-heartbeat-io", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((fn, args, future))
        return future

    def _serve(self) -> None:
        while True:
            fn, args, future = self._queue.get()
            try:
                future.set_result(fn(*args))
            except BaseException as err:
                future.set_exception(err)


class Heartbeat:
    def __init__(self, host: str, port: int, rank: int, world_size: int, prefix: str, timeout: float) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.liveness = contract.Liveness(timeout)
        self.interval = self.liveness.heartbeat_beat_seconds
        self.next_rank = (rank + 1) % world_size
        self._prefix = prefix
        # Its own connection. A store whose process is stopped (SIGSTOP) keeps the socket open
        # and never answers, and a store call cannot be interrupted: the calls run on a thread of
        # their own, and the watcher waits two beats for each round before counting it missed.
        self._store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=2 * self.interval),
            wait_for_workers=False,
        )
        self._io = _Calls()
        self._stop = threading.Event()
        self._failed = False  # this rank failed and named itself lost (fail)
        self._armed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtjob-heartbeat", daemon=True)

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self._prefix}/{what}" if rank is None else f"{self._prefix}/{what}/{rank}"

    def start(self) -> None:
        self._store.add(self._key("beat", self.rank), 1)
        self._thread.start()

    def arm(self) -> None:
        """From now on silence counts: training runs. Before, every rank is still starting (imports,
        data, the model) on cores it may share with its peers, and a peer lost then fails the
        start within the rendezvous and collective timeouts anyway."""
        self._armed.set()

    def finish(self) -> None:
        """This rank is done (the gang ended or stops as planned): nobody should wait for it."""
        self._stop.set()
        done = self._io.submit(self._store.add, self._key("done", self.rank), 1)
        with contextlib.suppress(RuntimeError, OSError, FutureTimeout):  # the store may be gone
            done.result(timeout=2 * self.interval)

    def fail(self) -> None:
        """This rank fails (an uncaught error): name it lost at once, so every peer exits
        EXIT_PEER_LOST within a beat wherever it is (#40: before, they waited `timeout` for its
        silence, or the collective timeout while its process lingered and its heartbeat beat on).
        This rank's own watcher stops: the verdict is not for it to act on."""
        self._failed = True
        self._stop.set()

        def publish() -> None:
            self._store.set(self._key("lost-rank"), str(self.rank))
            self._store.add(self._key("lost"), 1)

        with contextlib.suppress(RuntimeError, OSError, FutureTimeout):  # the store may be gone
            self._io.submit(publish).result(timeout=2 * self.interval)

    @property
    def verdict_seconds(self) -> float:
        """The longest a verdict takes once a peer is gone: the timeout and two beats."""
        return self.liveness.heartbeat_verdict_seconds

    def await_verdict(self, stopped: Callable[[], bool]) -> None:
        """Give the heartbeat the time to name a lost peer (it then ends the process with
        EXIT_PEER_LOST): up to `verdict_seconds`, less when `stopped()` turns true (a SIGTERM:
        the operator already restarts the gang). Not before training runs (`arm`)."""
        deadline = time.monotonic() + self.verdict_seconds
        if not self._armed.is_set():
            return
        while self._thread.is_alive() and not stopped() and time.monotonic() < deadline:
            self._thread.join(timeout=0.1)

    def _round(self) -> tuple[int, int | None, bool]:
        """One beat: (the next rank's beat, the rank declared lost or None, whether it is done)."""
        self._store.add(self._key("beat", self.rank), 1)
        theirs = self._store.add(self._key("beat", self.next_rank), 0)
        lost = None
        if self._store.add(self._key("lost"), 0):
            lost = int(self._store.get(self._key("lost-rank")).decode())
        return theirs, lost, bool(self._store.add(self._key("done", self.next_rank), 0))

    def _run(self) -> None:
        now = time.monotonic()
        seen, seen_at, contact_at = -1, now, now
        # A round starts a beat after the previous one started, or sooner when a timeout runs
        # out before that; a round waits two beats for the store at most, and no longer than the
        # store's own timeout leaves: a store that stopped answering is given up `timeout` s
        # after the last answer, not up to a round and a beat later (timeout 4 s, a pod cut off
        # in the chaos run: its gang's first exit 5.4 s after the cut, 7.1-10.6 s in three runs
        # before).
        slack = 0.01  # past the timeout, not at it: silence must exceed it
        due = now
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            now = time.monotonic()
            left = contact_at + self.timeout + slack - now
            try:
                round_ = self._io.submit(self._round)
                theirs, lost, done = round_.result(timeout=max(slack, min(2 * self.interval, left)))
            except (RuntimeError, OSError, FutureTimeout):
                silent = time.monotonic() - contact_at
                if silent > self.timeout:  # the store is rank 0's: it is gone, or we are cut off
                    self._leave(0, silent)
                due = min(now + self.interval, contact_at + self.timeout + slack)
                continue
            contact_at = now
            if self._failed:
                return
            if lost is not None:
                self._leave(lost, now - seen_at)
            if done:
                return  # the next rank finished: the end of the run, not a loss
            if theirs != seen or not self._armed.is_set():
                seen, seen_at = theirs, now
            elif now - seen_at > self.timeout:
                self._declare(self.next_rank, now - seen_at)
            due = min(now + self.interval, seen_at + self.timeout + slack)

    def _declare(self, rank: int, silent: float) -> None:
        def publish() -> None:
            self._store.set(self._key("lost-rank"), str(rank))
            self._store.add(self._key("lost"), 1)

        with contextlib.suppress(RuntimeError, OSError, FutureTimeout):
            self._io.submit(publish).result(timeout=2 * self.interval)
        # The store may live in this process (rank 0): keep it up until every other survivor has
        # read the verdict (each reads once a beat), or they would name rank 0 instead. Of a gang
        # of two, the lost rank is the only other one: nobody is left to read it (2 s sooner).
        if self.rank == 0 and self.world_size > 2:
            time.sleep(2 * self.interval)
        self._leave(rank, silent)

    def _leave(self, rank: int, silent: float) -> None:
        print(f"dtjob-trainer: {contract.peer_lost_line(rank, silent)}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(contract.EXIT_PEER_LOST)


def leave_failed(rank: int, why: str) -> None:
    """A peer said it failed (a dtjob collective raised GangAborted naming it): log the contract's
    peer-lost line and exit EXIT_PEER_LOST now, as the heartbeat's verdict does (#40)."""
    print(f"dtjob-trainer: {contract.peer_failed_line(rank, why)}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(contract.EXIT_PEER_LOST)


def start(gang_prefix: str, host: str, port: int, rank: int, world_size: int) -> Heartbeat | None:
    """Start watching the gang (timeout from DTJOB_HEARTBEAT_TIMEOUT, default 10 s; 0: off)."""
    timeout = contract.PodEnv.from_environ().heartbeat_timeout
    if world_size < 2 or timeout <= 0:
        return None
    beat = Heartbeat(host, port, rank, world_size, f"{gang_prefix}/hb", timeout)
    beat.start()
    log.info("heartbeat: rank %d watches rank %d, lost after %.0fs of silence", rank, beat.next_rank, timeout)
    return beat
