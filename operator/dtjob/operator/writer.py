"""A pass's writes, carried out without the pass waiting for them.

`JobWriter.submit(job, actions, on_head, on_done)` returns at once. The actions go out in two parts:

- The head, on a pool of its own (`job_write_concurrency` threads), in the reconciler's order:
  the status patch first (with the resourceVersion the pass read), then the job's other writes
  (its Service, its PodGroup, its deletion) and the operator's own metrics. The first that
  fails ends the head; nothing after it is sent, pod writes included: a decision is recorded in
  the status before any pod is created or deleted, so an operator killed half-way picks it up
  again from the status. `on_head(error)` says how it went; the job's next pass waits for it (the
  returned future), since it must start from the status this pass wrote.
- Once the head succeeded, the events and the pod creations and deletions, on the shared pool of
  `api_concurrency` threads. They are recorded as expectations (dtjob.operator.expectations)
  before the head's future resolves, so the job's next pass sees them as done and runs while
  they are in flight. The writes of one pod go out one after the other (a deletion asked for
  while the pod's creation is in flight is sent after it). `on_done(error)` comes once every pod
  write of the pass is answered, with the first that failed in the reconciler's order (the
  runner shows it on the job and retries with backoff).

Both pools run the most urgent write first (dtjob.operator.priority_pool, the priorities below):
the writes of a job already started before a new job's first ones; deletions before creations
and events. And a new job is admitted (`admit`: its first pass hands its writes over) only while
no more pod writes wait for a thread than the pod pool has threads, in the order the new jobs
asked: the operator takes on new jobs as fast as the API server takes the pod writes of those it
started, instead of queueing every new job's pods in front of them.

Every write's time from the pass handing it over to its answer goes into a histogram by kind
(`dtjob_operator_write_duration_seconds`): the reconcile histogram no longer holds it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from dtjob.operator.actions import (
    Action,
    ApplyPodGroup,
    CreatePod,
    CreateService,
    DeleteJob,
    DeletePod,
    EmitEvent,
    PatchStatus,
)
from dtjob.operator.expectations import Expectations, Expected, Key, PodWrite
from dtjob.operator.jobview import JobView
from dtjob.operator.priority_pool import PriorityPool

log = logging.getLogger("dtjob.operator")
Outcome = Callable[[Exception | None], None]

# Priorities on the writer's pools (dtjob.operator.priority_pool; 0 first). The head pool: the
# writes of a job already started before a new job's first ones. First come, first served, 500
# new jobs' first status patches and their 2,000 pod creations went ahead of the started jobs'
# status patches and restarts: pod writes waited 29 s p99 from their hand-over, status patches
# 9.7 s (bench/README.md "Scale").
STARTED, NEW = 0, 1
# New jobs admitted (`admit`) whose pod writes are not in the pod pool yet, at most: the pool's
# queue then stays within about its threads (32: 0.2-0.4 s at the 90-170 pod writes/s measured
# on KWOK) and 8 jobs' writes (4-5 each at 500 jobs of 4 workers).
GRANTS = 8
# The pod pool: deletions first (a restart and the capacity it frees wait for them), then
# creations and events in the pass's order (an event explains the writes after it).
DELETE, CREATE, EVENT = 0, 1, 1


class JobChanged(Exception):
    """The job changed between the pass's read and its status patch (which was refused): the
    pass decided on an old version, and runs again on the new one (no error)."""


class ActionFailed(Exception):
    """An action the API server (or the kubernetes client) refused; `error` says why."""

    def __init__(self, action: Action, error: Exception) -> None:
        super().__init__(f"{describe_action(action)}: {error}")
        self.action = action
        self.error = error


def describe_action(action: Action) -> str:
    """What an action does, in the words of an error message ("creating pod gpt-worker-0")."""
    match action:
        case PatchStatus():
            return "writing the job's status"
        case CreateService(manifest=manifest):
            return f"creating Service {manifest['metadata']['name']}"
        case ApplyPodGroup(manifest=manifest):
            return f"applying PodGroup {manifest['metadata']['name']}"
        case CreatePod():
            return f"creating pod {action.name}"
        case DeletePod(name=pod):
            return f"deleting pod {pod}"
        case DeleteJob():
            return "deleting the job"
        case EmitEvent(reason=reason):
            return f"posting event {reason}"
        case _:
            return f"recording {type(action).__name__}"


def write_kind(action: Action) -> str:
    """The label of a write in the write-latency histogram."""
    match action:
        case PatchStatus():
            return "status"
        case CreatePod():
            return "create_pod"
        case DeletePod():
            return "delete_pod"
        case EmitEvent():
            return "event"
        case _:
            return "other"


def log_pod_writes(job: JobView, writes: Sequence[PodWrite]) -> None:
    """One log line for a pass's pod creations and one for its deletions (with their reasons)."""
    for kind, group in (
        ("creating", [w for w in writes if isinstance(w, CreatePod)]),
        ("deleting", [w for w in writes if isinstance(w, DeletePod)]),
    ):
        if group:
            reasons = sorted({w.reason for w in group if isinstance(w, DeletePod)})
            why = f": {'; '.join(reasons)}" if reasons else ""
            log.info("%s/%s: %s %s%s", job.namespace, job.name, kind, _names([w.name for w in group]), why)


def _names(names: list[str]) -> str:
    """Pod names for one log line: "w-0", "w-0, w-1", or "w-0 .. w-9 (10 pods)" in the order given."""
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} .. {names[-1]} ({len(names)} pods)"


class _Batch:
    """The pod writes of one pass: `on_done` once all are answered, with the first failure in
    the order the pass gave them."""

    def __init__(self, count: int, on_done: Outcome) -> None:
        self._left = count
        self._errors: dict[int, Exception] = {}
        self._lock = threading.Lock()
        self._on_done = on_done

    def finished(self, index: int, error: Exception | None) -> None:
        with self._lock:
            if error is not None:
                self._errors[index] = error
            self._left -= 1
            if self._left:
                return
            first = self._errors[min(self._errors)] if self._errors else None
        _call(self._on_done, first)


def _call(outcome: Outcome, error: Exception | None) -> None:
    try:
        outcome(error)
    except Exception:  # the runner's bookkeeping failing must not stop the writer's threads
        log.exception("handling the outcome of a pass's writes failed")


class JobWriter:
    """Carries out passes' actions on its two pools; see the module's docstring."""

    def __init__(
        self,
        head: Callable[[JobView, Action], None],
        pod: Callable[[str, PodWrite], None],
        event: Callable[[JobView, EmitEvent], None],
        head_concurrency: int,
        pod_concurrency: int,
        observe: Callable[[str, float], None] = lambda kind, seconds: None,
        expectations: Expectations | None = None,
    ) -> None:
        self._head = head
        self._pod = pod
        self._event = event
        self._observe = observe
        self.expectations = expectations if expectations is not None else Expectations()
        self._heads = PriorityPool(head_concurrency, "job-write")
        self.pool = PriorityPool(pod_concurrency, "pod-write", on_take=self._grant)
        self._room = pod_concurrency  # pod writes waiting for a thread, at most, to admit a new job
        self._waiting: OrderedDict[Key, Callable[[], object]] = OrderedDict()
        self._granted: set[Key] = set()
        self._lock = threading.Lock()
        self._chains: dict[tuple[str, str], deque[Callable[[], None]]] = {}
        self._drained: dict[Key, tuple[int, Callable[[], object]]] = {}

    def submit(
        self, job: Mapping[str, Any], actions: Sequence[Action], on_head: Outcome, on_done: Outcome
    ) -> Future[None] | None:
        """Hands the actions over; returns the future the job's next pass waits for (None: no
        head to wait for, `on_head` was called already). `on_done` is not called when the head
        failed: none of the pod writes was sent."""
        view = JobView(job)
        new = not view.status.get("phase")
        head = [a for a in actions if not isinstance(a, (CreatePod, DeletePod, EmitEvent))]
        events = [a for a in actions if isinstance(a, EmitEvent)]
        pods = [a for a in actions if isinstance(a, (CreatePod, DeletePod))]
        handed = time.perf_counter()
        if not head:
            self._send(view, events, pods, handed, on_done)
            self._admitted((view.namespace, view.name))
            _call(on_head, None)
            return None
        held: Future[None] = Future()

        def run_head() -> None:
            error: Exception | None = None
            try:
                for action in head:
                    try:
                        self._head(view, action)
                    except JobChanged as changed:
                        error = changed
                    except Exception as failed:
                        error = ActionFailed(action, failed)
                    finally:
                        self._observe(write_kind(action), time.perf_counter() - handed)
                    if error is not None:
                        break
                if error is None:
                    self._send(view, events, pods, handed, on_done)
                self._admitted((view.namespace, view.name))
                _call(on_head, error)
            finally:
                held.set_result(None)

        self._heads.submit(run_head, priority=NEW if new else STARTED)
        return held

    def admit(self, job: Key, retry: Callable[[], object]) -> bool:
        """Whether a new job's pass may hand its writes over now: when no new job waits, fewer
        than GRANTS admitted ones have yet to send their pod writes, and no more pod writes wait
        for a thread than the pool has threads; or when its turn came. Otherwise it waits, and
        `retry()` is called once its turn comes, in the order the jobs asked (a job asking again
        keeps its place). An admitted job counts until its pass's pod writes are in the pool."""
        with self._lock:
            if job in self._granted:
                return True
            if not self._waiting and len(self._granted) < GRANTS and self.pool.queued() <= self._room:
                self._granted.add(job)
                return True
            self._waiting.setdefault(job, retry)
        self._grant()  # the pool may have drained before this job asked
        return False

    def _admitted(self, job: Key) -> None:
        """The job's pass sent its pod writes (or its head failed): the next new job's turn."""
        with self._lock:
            if job not in self._granted:
                return
            self._granted.discard(job)
        self._grant()

    def forget(self, job: Key) -> None:
        """The job is gone: it no longer waits for admission."""
        with self._lock:
            self._waiting.pop(job, None)
            self._granted.discard(job)
        self._grant()

    def _grant(self) -> None:
        """The turn of the first waiting new job, when the pod pool has room (see `admit`)."""
        with self._lock:
            if not self._waiting or len(self._granted) >= GRANTS or self.pool.queued() > self._room:
                return
            job, retry = self._waiting.popitem(last=False)
            self._granted.add(job)
        retry()

    def when_drained(self, job: Key, at_most: int, fn: Callable[[], object]) -> None:
        """Calls `fn()` once the job has at most `at_most` pod writes in flight (at once when it
        has already; a later call replaces a waiting one)."""
        with self._lock:
            if self.expectations.in_flight(job) > at_most:
                self._drained[job] = (at_most, fn)
                return
            self._drained.pop(job, None)
        fn()

    def _send(
        self, job: JobView, events: list[EmitEvent], pods: list[PodWrite], handed: float, on_done: Outcome
    ) -> None:
        for event in events:
            self.pool.submit(self._one_event, job, event, handed, priority=EVENT)
        if not pods:
            _call(on_done, None)
            return
        log_pod_writes(job, pods)
        key = (job.namespace, job.name)
        batch = _Batch(len(pods), on_done)
        for index, expected in enumerate(self.expectations.expect(key, pods)):
            task = functools.partial(self._pod_write, key, expected, index, batch, handed)
            priority = DELETE if isinstance(expected.write, DeletePod) else CREATE
            self._chain((job.namespace, expected.write.name), task, priority)

    def _one_event(self, job: JobView, event: EmitEvent, handed: float) -> None:
        try:
            self._event(job, event)
        except Exception as error:  # an event is worth a log line, never a failed reconcile
            log.warning("could not post event %s on %s/%s: %s", event.reason, job.namespace, job.name, error)
        finally:
            self._observe("event", time.perf_counter() - handed)

    def _chain(self, pod: tuple[str, str], task: Callable[[], None], priority: int) -> None:
        """Runs `task` on the pool after the pod's earlier writes (at the priority of the first
        write of the chain: the later ones follow it on its thread)."""
        with self._lock:
            queue = self._chains.get(pod)
            if queue is not None:
                queue.append(task)
                return
            self._chains[pod] = deque()
        self.pool.submit(self._run_chain, pod, task, priority=priority)

    def _run_chain(self, pod: tuple[str, str], task: Callable[[], None]) -> None:
        while True:
            try:
                task()
            except Exception:
                log.exception("a pod write of %s/%s failed unexpectedly", *pod)
            with self._lock:
                queue = self._chains[pod]
                if not queue:
                    del self._chains[pod]
                    return
                task = queue.popleft()

    def _pod_write(self, job: Key, expected: Expected, index: int, batch: _Batch, handed: float) -> None:
        write = expected.write
        error: Exception | None = None
        try:
            self._pod(job[0], write)
        except Exception as failed:
            error = ActionFailed(write, failed)
        finally:
            self._observe(write_kind(write), time.perf_counter() - handed)
            # After the answer went into the cache (the write function puts it there): a pass
            # from now on sees the pod in the cache, one before it saw the expectation.
            self._finished(job, expected)
        batch.finished(index, error)

    def _finished(self, job: Key, expected: Expected) -> None:
        left = self.expectations.done(job, expected)
        with self._lock:
            waiting = self._drained.get(job)
            if waiting is None or left > waiting[0]:
                return
            del self._drained[job]
        waiting[1]()
