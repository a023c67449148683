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
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
log = logging.getLogger("dtjob.operator")


class Coalescer(Generic[K]):
    """Runs `work(key)` for each `trigger(key)`: in the caller's thread when no run of that key is
    in flight, else by asking the run in flight to go once more. Triggers that arrive during one
    run coalesce into one more run.

    `lock` guards the two sets; it is a parameter so a test can act between its releases.
    """

    def __init__(self, work: Callable[[K], None], lock: AbstractContextManager[object] | None = None) -> None:
        self._work = work
        self._guard: AbstractContextManager[object] = lock if lock is not None else threading.Lock()
        self._running: set[K] = set()
        self._dirty: set[K] = set()

    def trigger(self, key: K) -> None:
        with self._guard:
            if key in self._running:
                self._dirty.add(key)
                return
            self._running.add(key)
        try:
            while True:
                self._work(key)
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
