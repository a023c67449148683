"""The impure side of a reconcile: observe a job, ask the pure reconciler, execute its actions.

`JobPassRunner.trigger_soon(namespace, name)` is what the kopf handlers, the operator's own watches
and its scraper call: it runs the pass on the runner's own threads a moment later
(`trigger_delay_seconds`; the changes of a gang's pods come in bursts, and one pass answers a
burst; at once for the two pod changes that decide a restart, see `ClusterCache._decides`), and
only for jobs that kopf handed to this operator within the last two timer intervals: a replica that
kopf's peering holds paused gets no job from kopf, so its watches act on none either. Triggers of
one job coalesce (`Coalescer`): never two passes of a job at once, and every trigger answered by a
pass that starts after it.

Passes without an event: each pass's plan says when time alone changes its decision
(`Plan.wake_at`: a deadline, a TTL, a hold) and whether it waits on what no watch announces
(`Plan.poll`: capacity, a Volcano queue). The runner triggers the job at that moment; kopf's
timer (`tick`, every `interval_seconds`) runs a pass only when one is due, a poll is due, or
`resync_seconds` passed since the job's last pass. 200 running jobs no longer cost 40 passes a
second that find nothing to do.

A new job's pass (no phase yet) hands its writes over only once the writer admits the job
(`JobWriter.admit`: while few pod writes wait for the API server, first come first served); until
then the job keeps no status and its pass runs again when its turn comes.

A pass reads the job from the operator's cache and its pods as the pod writes still in flight
will leave them (dtjob.operator.expectations), decides, and hands the actions to the writer
(dtjob.operator.writer) without waiting for their answers. The writer patches the status only
over the version the pass read (the resourceVersion is the patch's precondition): when the job
changed in between, the patch is refused, nothing of the pass is done (its status patch comes
first) and it runs again. The job's next pass starts once the status patch and the job's other
own writes are answered (it must start from the status this one wrote), not its pod writes: a
1,024-worker gang's creations go out while the passes after the first decide the rest.

No error of a pass is only a log line. Any exception while observing, deciding or acting shows
on the job as a Warning event (when the error is new) and the condition `Reconciled=False` with
the stage as its reason (ObserveFailed, ReconcileFailed, ActionFailed) and a short message with
the attempt and the next retry; a pod write that fails after its pass returned triggers the
job's next pass, which reports it so. The job is then retried with backoff (`RetrySettings`): other
triggers wait for the retry, so a failing job never loops, and the retry comes even for a job the
timer skips (a Suspended one). The pass after the first one that succeeds again, pod writes
included, sets `Reconciled=True` and posts a Normal event `Recovered`.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from dtjob.api import JobPhase
from dtjob.operator.actions import EmitEvent, PatchStatus
from dtjob.operator.coalescer import Coalescer, Later
from dtjob.operator.conditions import with_condition
from dtjob.operator.jobview import finalized
from dtjob.operator.kube import Kube
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.reconciler import Plan, plan
from dtjob.operator.settings import OperatorSettings
from dtjob.operator.writer import ActionFailed, JobChanged, describe_action

log = logging.getLogger("dtjob.operator")
RECONCILED = "Reconciled"
STAGE_REASONS = {"observe": "ObserveFailed", "decide": "ReconcileFailed", "act": "ActionFailed"}
# Condition and event messages stay short: the event is cut at 1024 characters by kube.py, and
# `kubectl describe` shows a condition's message on one line.
MESSAGE_LIMIT = 400

Key = tuple[str, str]


# A wake-up comes this much after the moment the plan named: the rules compare with `>` as well
# as `>=`, and a wake-up a little early would find nothing due yet.
WAKE_SLACK_SECONDS = 0.05


@dataclass
class _Next:
    """When a job's last pass succeeded and when it wants the next without an event (monotonic)."""

    passed_at: float
    due: float | None


@dataclass
class _Failing:
    """A job whose passes fail: how often in a row, the last error, and when to retry."""

    attempts: int
    reason: str
    detail: str
    retry_at: float  # monotonic
    timer: threading.Timer | None = None


class JobPassRunner:
    """Runs observe -> reconcile -> execute passes, one at a time per job."""

    def __init__(
        self,
        kube: Kube,
        metrics: OperatorMetrics,
        settings: OperatorSettings,
        clock: Callable[[], float] = time.monotonic,
        finalizer: str | None = None,
    ) -> None:
        """`finalizer`: a job gets no pass until it carries this finalizer (kopf's, put on every
        job right after it appears) or is being deleted, as the operator's cache holds it; the
        cache's event of the finalizer triggers the pass (see jobview.finalized)."""
        self.kube = kube
        self.finalizer = finalizer
        self.metrics = metrics
        self.settings = settings
        self._clock = clock
        self._soon = ThreadPoolExecutor(settings.max_workers, thread_name_prefix="pass")
        self._passes: Coalescer[Key] = Coalescer(self._once, spawn=self._soon.submit)
        self._lock = threading.Lock()
        self._failing: dict[Key, _Failing] = {}
        # A pod write of an earlier pass that failed, and a job whose pass succeeded whole after
        # failures: each reported by the job's next pass.
        self._write_failed: dict[Key, Exception] = {}
        self._recovering: dict[Key, _Failing] = {}
        # When each job's last status patch was answered (monotonic), and the jobs whose progress
        # waits for a pass at progress_write_seconds after it (each with the token of its wake-up).
        self._status_written: dict[Key, float] = {}
        self._progress_due: dict[Key, object] = {}
        self._handed: dict[Key, float] = {}  # job -> when kopf last handed it over (monotonic)
        self._queued: set[Key] = set()
        self._next: dict[Key, _Next] = {}
        self._later = Later("pass-delay")
        # Two timer ticks and a second: kopf's timer hands every job over once per interval.
        self._handed_for = 2 * settings.interval_seconds + 1.0

    def trigger(self, namespace: str, name: str) -> None:
        """Run a pass of this job now, or make the pass in flight go once more; while the job
        backs off after a failure, its scheduled retry answers the trigger."""
        self._passes.trigger((namespace, name))

    def handed(self, namespace: str, name: str) -> None:
        """kopf called a handler of this job: this operator is the one acting on it."""
        with self._lock:
            self._handed[(namespace, name)] = self._clock()

    def tick(self, namespace: str, name: str) -> None:
        """kopf's timer: kopf hands this operator the job; a pass runs when one is due (the
        plan's wake-up or poll, or `resync_seconds` since the last pass; at once for a job
        without a pass yet)."""
        self.handed(namespace, name)
        now = self._clock()
        with self._lock:
            last = self._next.get((namespace, name))
        if (
            last is None
            or now - last.passed_at >= self.settings.resync_seconds
            or (last.due is not None and now >= last.due)
        ):
            self.trigger_soon(namespace, name)

    def trigger_soon(self, namespace: str, name: str, urgent: bool = False) -> None:
        """`trigger` on the runner's threads after `trigger_delay_seconds`, returning at once; a
        job already waiting is not queued twice (the triggers meanwhile join its pass). `urgent`
        (a change that decides the pass by itself, such as a worker failing): without the delay,
        whether or not the job waits already. Ignored for a job kopf has not handed over lately."""
        key = (namespace, name)
        with self._lock:
            handed = self._handed.get(key)
            if handed is None or self._clock() - handed > self._handed_for:
                return
            if not urgent:
                if key in self._queued:
                    return
                self._queued.add(key)
        delay = self.settings.trigger_delay_seconds
        if urgent:
            self._soon.submit(self.trigger, namespace, name)
        elif delay > 0:
            self._later.call(delay, functools.partial(self._soon.submit, self._trigger_queued, key))
        else:
            self._soon.submit(self._trigger_queued, key)

    def _trigger_queued(self, key: Key) -> None:
        with self._lock:
            self._queued.discard(key)
        self.trigger(*key)

    def own_status(self, namespace: str, name: str, resource_version: str | None) -> bool:
        """Whether this version of the job is the one the operator's last status patch wrote: its
        event needs no pass (the pass that wrote it decided on it, and triggers the next itself
        when it changed the phase or generation). 500 jobs: about 3,000 of 8,300 passes."""
        written = self.kube.written.get((namespace, name))
        return written is not None and written == resource_version

    def forget(self, namespace: str, name: str) -> None:
        """The job is gone: drop its phase from the metrics and any pending retry."""
        self.metrics.job_phase(namespace, name, None)
        self.kube.forget(namespace, name)
        with self._lock:
            self._handed.pop((namespace, name), None)
            self._next.pop((namespace, name), None)
            self._write_failed.pop((namespace, name), None)
            self._recovering.pop((namespace, name), None)
            self._status_written.pop((namespace, name), None)
            self._progress_due.pop((namespace, name), None)
            failing = self._failing.pop((namespace, name), None)
        if failing is not None and failing.timer is not None:
            failing.timer.cancel()

    def failing_attempts(self, namespace: str, name: str) -> int:
        """Failed passes in a row of this job (0: its last pass succeeded)."""
        with self._lock:
            failing = self._failing.get((namespace, name))
            return failing.attempts if failing else 0

    # one pass ----------------------------------------------------------------------------
    def _once(self, key: Key) -> Future[None] | None:
        """Observe, decide, hand the actions to the writer; returns what the job's next pass waits
        for (its status patch and the job's other own writes; see dtjob.operator.writer)."""
        namespace, name = key
        with self._lock:
            write_failed = self._write_failed.pop(key, None)
            recovering = self._recovering.pop(key, None)
            failing = self._failing.get(key)
        if write_failed is not None:
            # A pod write of an earlier pass failed: shown on the job, retried with backoff.
            self._failed(key, True, "act", write_failed)
            return None
        if recovering is not None and recovering is failing:
            self._recovered(key, recovering)
            failing = None
        # 10 ms of slack: the retry timer may wake a little before its deadline.
        if failing is not None and self._clock() < failing.retry_at - 0.01:
            return None
        started = time.perf_counter()
        stage, job = "observe", None
        try:
            job = self.kube.get_job(namespace, name)
            if job is None:
                self.forget(namespace, name)
                return None
            if self.finalizer is not None and not finalized(job.get("metadata") or {}, self.finalizer):
                return None
            # A new job, admitted as the API server takes the pod writes (see the writer), is
            # asked before observing: at 500 jobs, passes deciding for jobs not admitted yet and
            # throwing the decision away doubled the passes (9,758 against 4,351) and the CPU.
            if not (job.get("status") or {}).get("phase") and not self.kube.writer.admit(
                key, functools.partial(self._soon.submit, self.trigger, namespace, name)
            ):
                return None
            observed = self.kube.observe(job)
            stage = "decide"
            decided = plan(observed, self.settings.reconciler)
            if decided.progress_only and self._progress_later(key):
                return None
            stage = "act"
            return self.kube.submit(
                job,
                decided.actions,
                functools.partial(self._written, key, job, decided, observed.now),
                functools.partial(self._all_written, key, failing),
            )
        except Exception as error:
            self._failed(key, job is not None, stage, error)
            return None
        finally:
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    def _written(
        self, key: Key, job: dict[str, Any], decided: Plan, now: datetime, error: Exception | None
    ) -> None:
        """The pass's status patch and the job's other own writes are answered (the job's next
        pass may start once this returns); its pod writes are on their way."""
        namespace, name = key
        if isinstance(error, JobChanged):
            # Nothing was done (the status patch comes first): decide again on the new version.
            log.debug("%s/%s: %s; deciding again", namespace, name, error)
            self.trigger(namespace, name)  # the job's pass is held: it goes once more
            return
        if error is not None:
            if _job_gone(error):
                self.forget(namespace, name)
            else:
                self._failed(key, True, "act", error)
            return
        patches = [action.status for action in decided.actions if isinstance(action, PatchStatus)]
        if patches:
            with self._lock:
                self._status_written[key] = self._clock()
                # This pass started after any pass that left the progress for later: its status
                # holds that progress, and the wake-up has nothing left to write (500 jobs of 4
                # workers: 545 of 5,059 passes were such wake-ups).
                self._progress_due.pop(key, None)
            if patches[0].get("phase") == JobPhase.RUNNING:
                # The rules of a running gang (rank 0's metrics, a stalled step, growing) ran
                # before this pass set the phase: the next pass decides on it (and names their
                # wake-ups). A status patch's own event triggers nothing else (`own_status`).
                self.trigger_soon(namespace, name)
        self._schedule_next(key, decided, now)
        if decided.more:
            # The pod writes this pass left over, as soon as the job has no more than one pass's
            # worth in flight: the write pool never runs dry while the next pass decides, and one
            # gang does not queue 1,024 writes ahead of every other job's (see Plan.more).
            at_most = self.settings.reconciler.pod_writes_per_pass
            self.kube.when_drained(key, at_most, functools.partial(self._soon.submit, self.trigger, *key))
        status = dict(job.get("status") or {})
        for patch in patches:
            status.update(patch)
        self.metrics.job_phase(namespace, name, status.get("phase"))
        self.metrics.job_status(namespace, name, status)

    def _progress_later(self, key: Key) -> bool:
        """Whether a status patch that only moves the workers' progress waits: when the job's
        last status patch is less than `progress_write_seconds` old. Its pass runs again then
        (one wake-up per job), and writes whatever the progress is by that time."""
        interval = self.settings.progress_write_seconds
        now = self._clock()
        with self._lock:
            written = self._status_written.get(key)
            if written is None or now - written >= interval:
                return False
            if key in self._progress_due:
                return True
            token = self._progress_due[key] = object()
        self._later.call(
            written + interval - now, functools.partial(self._soon.submit, self._progress_due_now, key, token)
        )
        return True

    def _progress_due_now(self, key: Key, token: object) -> None:
        with self._lock:
            if self._progress_due.get(key) is not token:
                return  # written meanwhile by a pass that had more to write, or a newer wake-up
            del self._progress_due[key]
        self.trigger(*key)

    def _all_written(self, key: Key, failing: _Failing | None, error: Exception | None) -> None:
        """Every pod write of the pass is answered: a failed one shows on the job (the next pass
        reports it and backs off), and a pass that succeeded whole after failures reports the
        job recovered (also in its next pass: the job's reports are written by its passes only)."""
        with self._lock:
            if error is not None:
                self._write_failed.setdefault(key, error)
            elif failing is not None:
                self._recovering[key] = failing
            else:
                return
        self._soon.submit(self.trigger, *key)

    def _schedule_next(self, key: Key, decided: Plan, now: datetime) -> None:
        """Remember when the job wants its next pass without an event, and trigger it then (a
        later pass replaces the wake-up: only the newest one triggers)."""
        delays = []
        if decided.wake_at is not None:
            delays.append((decided.wake_at - now).total_seconds() + WAKE_SLACK_SECONDS)
        if decided.poll:
            delays.append(self.settings.interval_seconds)
        passed_at = self._clock()
        nxt = _Next(passed_at, passed_at + min(delays) if delays else None)
        with self._lock:
            self._next[key] = nxt
        if nxt.due is not None and nxt.due - passed_at < self.settings.resync_seconds:
            self._later.call(max(0.0, nxt.due - passed_at), functools.partial(self._wake, key, nxt))

    def _wake(self, key: Key, nxt: _Next) -> None:
        with self._lock:
            if self._next.get(key) is not nxt:
                return  # a pass since then decided again
        self.trigger_soon(*key)

    # failure and recovery ----------------------------------------------------------------------
    def _failed(self, key: Key, job_seen: bool, stage: str, error: Exception) -> None:
        namespace, name = key
        reason = STAGE_REASONS[stage]
        detail = _short(describe_error(error, stage))
        with self._lock:
            previous = self._failing.get(key)
            attempts = previous.attempts + 1 if previous else 1
            delay = self.settings.retry.delay(attempts)
            timer = threading.Timer(delay, self.trigger, args=key)
            timer.daemon = True
            self._failing[key] = _Failing(attempts, reason, detail, self._clock() + delay, timer)
        if previous is not None and previous.timer is not None:
            previous.timer.cancel()
        timer.start()
        self.metrics.reconcile_errors.labels(stage=stage).inc()
        message = f"{detail} (attempt {attempts}; retrying in {delay:g}s)"
        log.warning("%s/%s: %s: %s", namespace, name, reason, message)
        if not job_seen:
            return  # the job itself could not be read: nothing to write on
        new = previous is None or (previous.reason, previous.detail) != (reason, detail)
        self._report(key, False, reason, message, EmitEvent("Warning", reason, detail) if new else None)

    def _recovered(self, key: Key, failing: _Failing) -> None:
        with self._lock:
            if self._failing.get(key) is failing:
                del self._failing[key]
        if failing.timer is not None:
            failing.timer.cancel()
        message = f"recovered after {failing.attempts} failed attempts; the last: {failing.detail}"
        log.info("%s/%s: %s", *key, message)
        self._report(
            key, True, RECONCILED, _short(message), EmitEvent("Normal", "Recovered", _short(message))
        )

    def _report(self, key: Key, ok: bool, reason: str, message: str, event: EmitEvent | None) -> None:
        """Write the Reconciled condition (on the job as it is now: the failed pass may have
        patched its status already) and post the event. Failing here is only a log line: the
        job cannot be written to, which the next attempt reports again."""
        namespace, name = key
        try:
            job = self.kube.get_job(namespace, name, fresh=True)  # rare: read it as it is now
            if job is None:
                return
            conditions = (job.get("status") or {}).get("conditions") or []
            updated = with_condition(conditions, RECONCILED, ok, reason, message, datetime.now(UTC))
            actions: list[Any] = [] if event is None else [event]
            self.kube.execute(job, [PatchStatus({"conditions": updated}), *actions])
        except Exception as error:
            log.warning("%s/%s: could not report %s on the job: %s", namespace, name, reason, error)


def describe_error(error: Exception, stage: str) -> str:
    """One line saying what failed and why."""
    if isinstance(error, ActionFailed):
        return f"{describe_action(error.action)}: {_cause(error.error)}"
    doing = {"observe": "observing the job", "decide": "deciding what to do"}.get(stage, stage)
    return f"{doing}: {_cause(error)}"


def _cause(error: Exception) -> str:
    if isinstance(error, ApiException):
        return f"{error.status} {error.reason}: {_api_message(error)}"
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        value = (
            f" (got {first['input']!r})" if "input" in first and not isinstance(first["input"], dict) else ""
        )
        return f"the kubernetes client refused {error.title} {where}: {first['msg']}{value}{more}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _api_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message", error.body))
    except ValueError:
        return str(error.body)


def _job_gone(error: Exception) -> bool:
    """The job was deleted during the pass: its status is no longer there to write."""
    return (
        isinstance(error, ActionFailed)
        and isinstance(error.action, PatchStatus)
        and isinstance(error.error, ApiException)
        and error.error.status == 404
    )


def _short(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."
