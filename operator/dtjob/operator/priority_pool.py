"""A pool of threads that runs the most urgent call first: the writer's pools (dtjob.operator.writer).

`ThreadPoolExecutor` runs calls in the order they came. At 500 jobs of 4 workers created at
once that order made every write wait for all the writes before it: a failed gang's deletions
behind 2,000 creations, a job's status patch behind 500 new jobs' first ones (pod writes 29 s
p99, status patches 9.7 s, bench/README.md "Scale"). Here each call has a priority (0 first,
then 1, ...; in the order they came within one), and a priority may be held back altogether
while `admits(priority)` says no: the writer holds new jobs' first writes while the pod writes
of the jobs it has started wait for a thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

log = logging.getLogger("dtjob.operator")
T = TypeVar("T")


class PriorityPool:
    """`threads` threads (started as calls come) running submitted calls by priority. `admits`
    is asked about the most urgent waiting call whenever a call comes or ends, and on `poke()`:
    a held priority must hold every less urgent one too (only the first call is asked about).
    `on_take()` is called each time a call leaves the queue for a thread."""

    def __init__(
        self,
        threads: int,
        name: str,
        admits: Callable[[int], bool] = lambda priority: True,
        on_take: Callable[[], object] = lambda: None,
    ) -> None:
        self._size = threads
        self._name = name
        self._admits = admits
        self._on_take = on_take
        self._queue: list[tuple[int, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._wake = threading.Condition()
        self._threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., T], *args: Any, priority: int = 0) -> Future[T]:
        """Queues `fn(*args)`; its future holds what it returned or raised."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args))
            except BaseException as error:  # the future carries it to whoever waits
                future.set_exception(error)

        with self._wake:
            heapq.heappush(self._queue, (priority, next(self._order), run))
            if len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._wake.notify()
        return future

    def queued(self) -> int:
        """Calls waiting for a thread."""
        with self._wake:
            return len(self._queue)

    def poke(self) -> None:
        """Ask `admits` again (what it depends on changed)."""
        with self._wake:
            self._wake.notify_all()

    def _take(self) -> Callable[[], None]:
        with self._wake:
            while not self._queue or not self._admits(self._queue[0][0]):
                self._wake.wait()
            run = heapq.heappop(self._queue)[2]
            if self._queue:
                self._wake.notify()  # the next call may be admitted now, for another thread
        return run

    def _work(self) -> None:
        while True:
            run = self._take()
            try:
                self._on_take()
            except Exception:
                log.exception("%s: on_take failed", self._name)
            run()
            with self._wake:
                self._wake.notify_all()  # a call ended: what `admits` depends on may have changed
