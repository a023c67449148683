"""Coalescing of triggers: at most one run per key in flight, and no trigger ever lost; and
`Later`, which runs calls after a delay (so triggers arriving meanwhile can join them).

kopf calls a handler for every event of a job or of its pods and on every timer tick, from
several threads at once. A pass of a job must not run twice at the same time (two passes could
both create the next generation's pods), and a trigger that arrives while a pass runs must still
be answered by a pass that starts after it (the pass in flight may have read the job before the
change the trigger announces).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
log = logging.getLogger("dtjob.operator")


class Coalescer(Generic[K]):
    """Runs `work(key)` for each `trigger(key)`: in the caller's thread when no run of that key is
    in flight, else by asking the run in flight to go once more. Triggers that arrive during one
    run coalesce into one more run.

    A run may go on after `work` returns: `work` returns a future (the pass's writes that the
    next pass must see, dtjob.operator.writer) and the run holds the key until it resolves; the
    next run, when a trigger came meanwhile, then starts through `spawn` (the resolving thread is
    the writer's). `work` returning None: the run is over.

    `lock` guards the two sets; it is a parameter so a test can act between its releases.
    """

    def __init__(
        self,
        work: Callable[[K], Future[None] | None],
        lock: AbstractContextManager[object] | None = None,
        spawn: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self._work = work
        self._guard: AbstractContextManager[object] = lock if lock is not None else threading.Lock()
        self._spawn: Callable[[Callable[[], None]], object] = spawn or _in_a_thread
        self._running: set[K] = set()
        self._dirty: set[K] = set()

    def trigger(self, key: K) -> None:
        with self._guard:
            if key in self._running:
                self._dirty.add(key)
                return
            self._running.add(key)
        self._run(key)

    def _run(self, key: K) -> None:
        try:
            while True:
                held = self._work(key)
                if held is not None:
                    held.add_done_callback(lambda _: self._released(key))
                    return
                with self._guard:
                    # Deciding to stop and leaving the running set happen under one lock: a
                    # trigger arriving after this block finds the key not running and runs the
                    # work itself; one arriving before it is seen here as dirty.
                    if key not in self._dirty:
                        self._running.discard(key)
                        return
                    self._dirty.discard(key)
        except BaseException:
            # The pass runner reports and retries its own errors; what reaches here (SystemExit,
            # KeyboardInterrupt) ends the process, and only must not leave the key marked running.
            with self._guard:
                self._running.discard(key)
                self._dirty.discard(key)
            raise

    def _released(self, key: K) -> None:
        """A held run's future resolved: the run ends, or goes once more when triggered meanwhile."""
        with self._guard:
            if key not in self._dirty:
                self._running.discard(key)
                return
            self._dirty.discard(key)
        self._spawn(lambda: self._run(key))


def _in_a_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="coalescer", daemon=True).start()


class Later:
    """Calls each `call(delay, fn)`'s `fn()` `delay` seconds later, in the order of their
    deadlines, on one thread for all of them (started at the first call)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._due: list[tuple[float, int, Callable[[], object]]] = []
        self._order = itertools.count()  # ties keep the order of the calls
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def call(self, delay: float, fn: Callable[[], object]) -> None:
        with self._wake:
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._order), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._due or self._due[0][0] > time.monotonic():
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                fn = heapq.heappop(self._due)[2]
            try:
                fn()
            except Exception:  # one failing call must not stop the ones after it
                log.exception("%s: a delayed call failed", self._name)
