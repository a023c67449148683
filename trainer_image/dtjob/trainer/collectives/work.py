"""Ordering and asynchrony: one runner per process group runs its collectives in call order.

Every rank must issue collectives on a group in the same order (as with torch.distributed).

CPU tensors (gloo): waiting for a message blocks the thread, so a synchronous call with nothing
queued runs inline in the caller's thread (no hand-off latency), and an async call, or a
synchronous call while async ones are still queued, goes to the group's single worker thread,
which runs them one at a time in submission order. So two async operations in flight never
interleave their messages, and no cross-rank deadlock can come from reordering.

CUDA tensors (NCCL): nothing in a call blocks the host (peers.py), so every call runs inline, in
call order, and only queues work on the device. A synchronous call queues it on the caller's
current stream. An async call queues it on the group's side stream for that device, after what
the caller's stream has queued so far, so the caller's stream runs on while it communicates
(torch's NCCL collectives do the same on NCCL's stream); its handle's wait() makes the caller's
current stream wait for it, as torch's does, without blocking the host.

Each call gets the next value of the group's sequence counter as its p2p tags.
A runner lives as long as its process group: it holds the group weakly, and the group's
finalizer stops its worker thread, so destroy_process_group() needs no call into this module.
"""

from __future__ import annotations

import datetime
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dtjob.trainer.collectives import abort
from dtjob.trainer.collectives.tuning import Trials

# Tags live in the upper half of the int32 range so they never meet the small tags a user's own
# isend/irecv on the same group would use (gloo matches messages on (peer, tag)). Each call owns
# TAGS_PER_CALL consecutive tags: the phases of a composite algorithm (hier) use one each.
_TAG_BASE = 1 << 30
_TAG_SPAN = 1 << 30
TAGS_PER_CALL = 4
# A group's close waits this long for its worker thread: the queued calls fail fast on a
# destroyed group; one stuck with a dead peer is not waited for.
CLOSE_TIMEOUT_SECONDS = 5.0

# A job runs one collective with the given tag and returns the name of the algorithm it ran.
Job = Callable[[int], str]


class CollectiveWork:
    """The handle of an async collective, like torch's `Work`: wait(), is_completed(),
    get_future(), synchronize(), result(), exception().

    get_future() returns a torch.futures.Future whose value is the call's output tensors as a
    list ([tensor] for all_reduce and broadcast, [output] for the other two: what NCCL's futures
    hold), so DDP communication hooks and torch.futures code use it unchanged. On CUDA the future
    is CUDA-aware: whoever waits on it, or chains on it with then(), is ordered after the call on
    the device.
    """

    def __init__(self, tensors: list[torch.Tensor], device: torch.device | None = None) -> None:
        self._tensors = tensors
        self._device = device if device is not None and device.type == "cuda" else None
        self._done = threading.Event()
        self._lock = threading.RLock()
        self._error: BaseException | None = None
        self._algorithm: str | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        self._event: torch.cuda.Event | None = None  # CUDA: recorded after the call's last kernel
        self._native: dist.Work | None = None  # a call of the backend's own collective

    # -- how the collectives complete a handle

    def _finish(self, algorithm: str | None) -> None:
        with self._lock:
            self._algorithm = algorithm
            self._done.set()
            future = self._future
        if future is not None:
            future.set_result(self._tensors)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
            self._done.set()
            future = self._future
        if future is not None:
            future.set_exception(error)  # type: ignore[arg-type]  # torch's stub types it as the value

    @classmethod
    def completed(cls, tensors: list[torch.Tensor], algorithm: str | None) -> CollectiveWork:
        """A call that finished in the caller's thread (or needed no communication)."""
        work = cls(tensors)
        work._finish(algorithm)
        return work

    @classmethod
    def queued_on(
        cls, tensors: list[torch.Tensor], algorithm: str, stream: torch.cuda.Stream
    ) -> CollectiveWork:
        """A CUDA call queued on `stream` (the side stream): done once the stream gets there."""
        work = cls(tensors, stream.device)
        work._event = torch.cuda.Event()
        work._event.record(stream)
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=[stream.device])
        with torch.cuda.stream(stream):
            future.set_result(tensors)  # a CUDA-aware future records its event on the current stream
        work._future = future
        work._algorithm = algorithm
        work._done.set()
        return work

    @classmethod
    def of_native(cls, work: dist.Work, tensors: list[torch.Tensor]) -> CollectiveWork:
        """torch's own async collective (nothing left to do after it: see native.py)."""
        handle = cls(tensors, tensors[0].device if tensors else None)
        handle._native = work
        handle._algorithm = "native"
        return handle

    # -- torch's Work interface

    @property
    def algorithm(self) -> str | None:
        """The algorithm this call ran ("auto" resolved), once it completed; None before, or if none ran."""
        if self._native is not None:
            return "native"
        if not self._done.is_set() or self._error is not None:
            return None
        return self._algorithm

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done (on CUDA: make the current stream wait); re-raises the call's error."""
        if self._native is not None:
            with abort.guard():  # a peer gone: GangAborted, and this rank's groups broken (#40)
                return bool(self._native.wait() if timeout is None else self._native.wait(timeout))
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            raise RuntimeError(f"collective did not complete within {timeout}")
        if self._error is not None:
            raise self._error
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        return True

    def synchronize(self) -> None:
        """torch's Work.synchronize(): the current stream waits for the call (CPU: wait())."""
        self.wait()

    def is_completed(self) -> bool:
        if self._native is not None:
            return bool(self._native.is_completed())
        if self._event is not None:
            return bool(self._event.query())
        return self._done.is_set()

    def is_success(self) -> bool:
        if self._native is not None:
            # torch's own answer: on torch < 2.12 native exception() cannot say (see below).
            return bool(self._native.is_completed() and self._native.is_success())
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if self._native is not None:
            try:
                return self._native.exception() if self._native.is_completed() else None
            except RuntimeError:  # some backends' works do not keep it
                return None
            except TypeError:  # torch 2.11: pybind cannot convert the exception_ptr it returns
                return None
        return self._error if self._done.is_set() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A torch.futures.Future of the output tensors (see the class docstring)."""
        with self._lock:
            if self._future is not None:
                return self._future
            if self._native is not None:
                self._future = _native_future(self)
                return self._future
            future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
            self._future = future
            done, error = self._done.is_set(), self._error
        if done:
            if error is not None:
                future.set_exception(error)  # type: ignore[arg-type]
            else:
                future.set_result(self._tensors)
        return future

    def __repr__(self) -> str:
        return f"CollectiveWork(algorithm={self.algorithm!r}, completed={self.is_completed()})"


def _native_future(handle: CollectiveWork) -> torch.futures.Future[list[torch.Tensor]]:
    """The future of a native call: torch's own, chained to our value, where the backend has one;
    else one completed by a waiter thread."""
    work = handle._native
    assert work is not None
    try:
        theirs = work.get_future()
    except RuntimeError:  # e.g. gloo's reduce_scatter_tensor has none
        pass
    else:
        tensors = handle._tensors
        return theirs.then(lambda _: tensors)
    devices: list[int | str | torch.device] | None = [handle._device] if handle._device is not None else None
    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=devices)
    _waiter.put((handle, future))
    return future


class _Waiter:
    """One daemon thread that waits on native works whose backend gives no future, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[CollectiveWork, torch.futures.Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, item: tuple[CollectiveWork, torch.futures.Future[Any]]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dtjob-native-futures", daemon=True)
                self._thread.start()
        self._queue.put(item)

    def _loop(self) -> None:
        while True:
            handle, future = self._queue.get()
            try:
                handle.wait()
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(handle._tensors)


_waiter = _Waiter()


class GroupRunner:
    """Sequence counter, worker thread, side streams and per-group caches of one process group."""

    def __init__(self, group: dist.ProcessGroup, weak: bool = True) -> None:
        self._group: Callable[[], dist.ProcessGroup | None] = weakref.ref(group) if weak else lambda: group
        self.rank = group.rank()
        self.size = group.size()
        self.global_ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(group))
        self.cache: dict[str, object] = {}  # e.g. the calibrated cost model (calibration.py)
        self.trials: dict[tuple[str, str, str, int], Trials] = {}  # auto's timed candidates per kind
        self.scratch_pool: dict[tuple[int, torch.dtype, torch.device, int], torch.Tensor] = {}
        self.last_algorithm: dict[str, str] = {}  # op -> algorithm of its latest call (for inspection)
        self.offered: dict[tuple[object, ...], tuple[str, ...]] = {}  # api._offered, per kind of call
        self._seq = 0
        self._pending = 0
        self._mutex = threading.Lock()
        self._idle = threading.Condition(self._mutex)
        self._run_lock = threading.Lock()
        self._device_lock = threading.Lock()
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._queue: queue.SimpleQueue[tuple[Job, int, CollectiveWork] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this collective was destroyed")
        return group

    def next_tag(self) -> int:
        with self._mutex:
            return self._take_tag()

    def _take_tag(self) -> int:
        tag = _TAG_BASE + (self._seq * TAGS_PER_CALL) % _TAG_SPAN
        self._seq += 1
        return tag

    def submit(
        self,
        job: Job,
        async_op: bool,
        result: list[torch.Tensor],
        device: torch.device,
        touched: list[torch.Tensor] | None = None,
    ) -> CollectiveWork | None:
        """Run `job` in call order; returns the handle of an async call. `result` is what its
        future holds, `touched` every tensor it reads or writes (kept alive for a side stream)."""
        if device.type == "cuda":
            return self._submit_on_device(job, async_op, result, device, touched or result)
        with self._mutex:
            tag = self._take_tag()
            inline = not async_op and self._pending == 0
            if not inline:
                self._pending += 1
                work = CollectiveWork(result)
                self._queue.put((job, tag, work))
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._work_loop, name=f"dtjob-collectives-{id(self):x}", daemon=True
                    )
                    self._thread.start()
        if inline:
            with self._run_lock, abort.guard():
                job(tag)
            return None
        if async_op:
            return work
        work.wait()
        return None

    def _submit_on_device(
        self,
        job: Job,
        async_op: bool,
        result: list[torch.Tensor],
        device: torch.device,
        touched: list[torch.Tensor],
    ) -> CollectiveWork | None:
        with self._device_lock:
            tag = self.next_tag()
            if not async_op:
                with abort.guard():
                    job(tag)
                return None
            side = self._side.get(device)
            if side is None:
                side = self._side[device] = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                algorithm = job(tag)
            for tensor in touched:  # the caching allocator must not reuse them before side is done
                tensor.record_stream(side)
            return CollectiveWork.queued_on(result, algorithm, side)

    def drain(self) -> None:
        """Block until every queued call of the group has run (before a collective step that the
        caller runs itself: calibration, the trials' agreement, a timed native call)."""
        with self._idle:
            while self._pending:
                self._idle.wait()

    def run_now(self, job: Job) -> str:
        """Run `job` inline after the queued calls, with the next tag (the same call on every rank)."""
        self.drain()
        with self._run_lock, abort.guard():
            return job(self.next_tag())

    def close(self) -> None:
        """Stop the worker thread once the queued calls have run (the group is gone), and wait for
        it: its exit frees the last call's tensors, and a tensor freed on a daemon thread while
        the interpreter shuts down aborts the process (std::terminate, exit 134; seen in 3 of 20
        two-rank runs of examples/hf-gpt2 before this wait, 0 of 12 after). Once the interpreter
        is finalizing, the thread can run no Python again and ends where it waits: nothing to
        wait for."""
        self._queue.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and not sys.is_finalizing():
            thread.join(timeout=CLOSE_TIMEOUT_SECONDS)

    def _work_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, tag, work = item
            try:
                with self._run_lock, abort.guard():
                    algorithm = job(tag)
            except BaseException as error:
                work._fail(error)
            else:
                work._finish(algorithm)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


_runners: weakref.WeakKeyDictionary[dist.ProcessGroup, GroupRunner] = weakref.WeakKeyDictionary()
_strong_runners: dict[int, GroupRunner] = {}  # for groups a torch build cannot reference weakly
_runners_lock = threading.Lock()


def runner_for(group: dist.ProcessGroup) -> GroupRunner:
    """The runner of `group`, created on first use; it goes when the group object goes."""
    with _runners_lock:
        try:
            runner = _runners.get(group)
        except TypeError:
            runner = _strong_runners.get(id(group))
            if runner is None or runner._group() is not group:
                runner = _strong_runners[id(group)] = GroupRunner(group, weak=False)
                abort.register(group)
            return runner
        if runner is None:
            runner = GroupRunner(group)
            _runners[group] = runner
            weakref.finalize(group, runner.close)
            abort.register(group)  # broken when a rank fails, so its peers fail fast (#40)
        return runner
