"""Ordering and asynchrony: one runner per process group executes its collectives in call order.

Every rank must issue collectives on a group in the same order (as with torch.distributed). A
synchronous call with nothing queued runs inline in the caller's thread (no hand-off latency); an
async call, or a synchronous call while async ones are still queued, goes to the group's single
worker thread, which runs them one at a time in submission order. So two async operations in
flight never interleave their messages, and no cross-rank deadlock can come from reordering.
Each call gets the next value of the group's sequence counter as its p2p tag.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from dtjob.trainer.collectives.tuning import Trials

# Tags live in the upper half of the int32 range so they never meet the small tags a user's own
# isend/irecv on the same group would use (gloo matches messages on (peer, tag)).
_TAG_BASE = 1 << 30
_TAG_SPAN = 1 << 30

# A job runs one collective with the given tag and returns the name of the algorithm it ran.
Job = Callable[[int], str]


class CollectiveWork:
    """Handle of an async collective, like torch's `Work`: wait(), is_completed(), result()."""

    def __init__(self, future: Future[str | None], tensors: list[torch.Tensor]) -> None:
        self._future = future
        self._tensors = tensors

    @property
    def algorithm(self) -> str | None:
        """The algorithm this call ran ("auto" resolved), once it completed; None before, or if none ran."""
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done; re-raises the collective's error (a dead peer, a timeout)."""
        seconds = None if timeout is None else timeout.total_seconds()
        self._future.result(seconds)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def __repr__(self) -> str:
        return f"CollectiveWork(completed={self.is_completed()})"


class GroupRunner:
    """Sequence counter, worker thread and per-group caches of one process group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.cache: dict[str, object] = {}  # e.g. the calibrated cost model (selection.py)
        self.trials: dict[tuple[str, str, int], Trials] = {}  # auto's timed candidates per kind of call
        self.scratch_pool: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # see Comm.scratch
        self.last_algorithm: dict[str, str] = {}  # op -> algorithm of its latest call (for inspection)
        self._seq = 0
        self._pending = 0
        self._mutex = threading.Lock()
        self._run_lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Job, int, Future[str | None]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Job, async_op: bool, tensors: list[torch.Tensor]) -> CollectiveWork | None:
        with self._mutex:
            tag = _TAG_BASE + self._seq % _TAG_SPAN
            self._seq += 1
            inline = not async_op and self._pending == 0
            if not inline:
                self._pending += 1
                future: Future[str | None] = Future()
                self._queue.put((job, tag, future))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._work_loop, name=f"dtjob-collectives-{id(self.group):x}", daemon=True
                    )
                    self._thread.start()
        if inline:
            with self._run_lock:
                job(tag)
            return None
        work = CollectiveWork(future, tensors)
        if async_op:
            return work
        work.wait()
        return None

    def _work_loop(self) -> None:
        while True:
            job, tag, future = self._queue.get()
            try:
                with self._run_lock:
                    algorithm = job(tag)
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(algorithm)
            finally:
                with self._mutex:
                    self._pending -= 1


def completed_work(tensors: list[torch.Tensor]) -> CollectiveWork:
    """The handle of a call that needed no communication (one rank, or an empty tensor)."""
    future: Future[str | None] = Future()
    future.set_result(None)
    return CollectiveWork(future, tensors)


_runners: dict[int, GroupRunner] = {}
_runners_lock = threading.Lock()


def runner_for(group: dist.ProcessGroup) -> GroupRunner:
    """The runner of `group` (created on first use; keyed by object identity)."""
    with _runners_lock:
        runner = _runners.get(id(group))
        if runner is None or runner.group is not group:
            runner = GroupRunner(group)
            _runners[id(group)] = runner
        return runner


def forget_groups() -> None:
    """Drop every runner and cache (call after destroy_process_group, e.g. on an elastic restart)."""
    with _runners_lock:
        _runners.clear()
