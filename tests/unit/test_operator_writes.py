"""Writes that do not hold the pass, without a cluster: what a pass sees of the pod writes still in
flight (expectations), the order in which the writer sends a pass's actions, and the pass runner
on top of it (the next pass runs while pod writes are in flight; a pod write failing after its
pass shows on the job)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.rest import ApiException

from dtjob.operator.actions import (
    Action,
    CountRestart,
    CreatePod,
    DeletePod,
    EmitEvent,
    PatchStatus,
)
from dtjob.operator.expectations import Expectations, overlay
from dtjob.operator.jobview import FINALIZER, JobView
from dtjob.operator.kube import same_but_bookkeeping
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.nodes import silent_deletion
from dtjob.operator.observed import Observed, Worker
from dtjob.operator.passes import JobPassRunner
from dtjob.operator.reconciler import plan, reconcile
from dtjob.operator.settings import OperatorSettings, ReconcilerSettings, RetrySettings
from dtjob.operator.writer import ActionFailed, JobChanged, JobWriter, Outcome
from tests.unit.reconciler_fixtures import (
    at,
    creates,
    deletes,
    env_of,
    events,
    make_job,
    make_node,
    make_pod,
    running_status,
    seen_through,
    settle,
    status_patch,
)

JOB = ("ml", "gpt")


def ranks(actions: list[Action]) -> list[int]:
    return [int(env_of(c.manifest)["RANK"]) for c in creates(actions)]


def pending(*writes: CreatePod | DeletePod) -> dict[str, list[CreatePod | DeletePod]]:
    expectations = Expectations()
    expectations.expect(JOB, list(writes))
    return expectations.pending(JOB)


# --- what a pass sees of the writes in flight --------------------------------------------------------
def test_creations_in_flight_are_pending_pods_and_the_next_pass_creates_the_rest() -> None:
    settings = ReconcilerSettings(pod_writes_per_pass=96)
    job = make_job(replicas=200, min_replicas=1, max_replicas=200, cpu="100m")
    nodes = [make_node(f"n{i}", cpu="64") for i in range(4)]
    job = {
        **job,
        "status": status_patch(reconcile(Observed(job=job, pods=[], nodes=nodes, now=at(0)), settings)),
    }
    in_flight: list[CreatePod | DeletePod] = []
    made: list[list[int]] = []
    while True:  # no write answered yet: the cache holds no pod of the job
        pods = overlay([], pending(*in_flight), at(1))
        decided = plan(Observed(job=job, pods=pods, nodes=nodes, now=at(1)), settings)
        made.append(ranks(decided.actions))
        in_flight += creates(decided.actions)
        if not decided.more:
            break
    assert [len(m) for m in made] == [96, 96, 8]
    assert sorted(r for m in made for r in m) == list(range(200)), "each rank created once"
    seen = [Worker.of(p) for p in overlay([], pending(*in_flight), at(1))]
    assert {(w.phase, w.node_name, w.generation, w.created) for w in seen} == {("Pending", None, 0, at(1))}


def test_a_pass_sends_no_more_pod_writes_than_twice_its_bound_less_those_in_flight() -> None:
    settings = ReconcilerSettings(pod_writes_per_pass=96)
    job = make_job(replicas=400, min_replicas=1, max_replicas=400, cpu="100m")
    nodes = [make_node(f"n{i}", cpu="64") for i in range(4)]
    started = reconcile(Observed(job=job, pods=[], nodes=nodes, now=at(0)), settings)
    job = {**job, "status": status_patch(started)}
    for in_flight, sent in ((0, 96), (96, 96), (150, 42), (192, 0), (300, 0)):
        seen = Observed(job=job, pods=[], nodes=nodes, now=at(1), pod_writes_in_flight=in_flight)
        decided = plan(seen, settings)
        assert (len(creates(decided.actions)), decided.more) == (sent, True), in_flight


def test_a_pod_the_cache_holds_wins_over_its_creation_in_flight() -> None:
    running = make_pod(0, phase="Running", node="n1")
    create = CreatePod({"metadata": {"name": "gpt-worker-0", "labels": {}}, "spec": {"containers": []}})
    assert overlay([running], pending(create), at(5)) == [running]


def test_deletions_in_flight_are_not_sent_again_nor_taken_for_a_silent_kubelet() -> None:
    settings = ReconcilerSettings(pod_writes_per_pass=96)
    size = 200
    job = make_job(replicas=size, min_replicas=1, max_replicas=size, status=running_status(size))
    nodes = [make_node(f"n{i}", cpu="64") for i in range(4)]
    pods = [make_pod(r, node=f"n{r % 4}") for r in range(size)]
    pods[7] = make_pod(7, phase="Failed", node="n3", exit_code=1)
    first = plan(Observed(job=job, pods=pods, nodes=nodes, now=at(100)), settings)
    assert status_patch(first.actions)["generation"] == 1 and first.more
    job = {**job, "status": {**job["status"], **status_patch(first.actions)}}
    # A minute later (far past every grace period) none of the deletions has been answered.
    in_flight = deletes(first.actions)
    seen = overlay(pods, pending(*in_flight), at(160))
    later = plan(Observed(job=job, pods=seen, nodes=nodes, now=at(160)), settings)
    asked = {d.name for d in in_flight}
    again = deletes(later.actions)
    assert len(again) == 96 and not asked & {d.name for d in again}, "the next 96, none twice"
    assert not [e for e in events(later.actions) if e.reason == "NodeSilent"]
    assert all(d.grace_seconds is None or d.grace_seconds == 5 for d in again), "no forced deletion"


def test_a_deletion_in_flight_ends_its_grace_period_no_earlier_than_the_pass_sees_it() -> None:
    pod = make_pod(3, node="n1")
    lost = DeletePod("gpt-worker-3", "rank 3 lost by its peers", grace_seconds=1)
    for now in (at(10), at(100), at(1000)):  # however long the deletion waited for the pool
        [seen] = overlay([pod], pending(lost), now)
        w = Worker.of(seen)
        assert w.deleting and w.deletion_grace == 1 and w.deletion_deadline is not None
        assert w.deletion_deadline >= now and not silent_deletion(w, now)
    own = DeletePod("gpt-worker-3", "generation 0 replaced")  # the pod's own grace period
    pod["spec"]["terminationGracePeriodSeconds"] = 20
    [seen] = overlay([pod], pending(own), at(10))
    assert Worker.of(seen).deletion_deadline == at(30)
    already = make_pod(3, deleting=True, grace_ends=50)
    assert overlay([already], pending(own), at(10)) == [already], "the API server's deadline stands"


def test_a_pod_created_and_deleted_in_flight_is_a_deleting_pending_pod_and_gone_once_answered() -> None:
    manifest = copy.deepcopy(make_pod(0, node=None))
    manifest.pop("status")
    create, delete = CreatePod(manifest), DeletePod("gpt-worker-0", "x", grace_seconds=0)
    [seen] = overlay([], pending(create, delete), at(1))
    assert Worker.of(seen).deleting and Worker.of(seen).phase == "Pending"
    expectations = Expectations()
    recorded = expectations.expect(JOB, [create, delete])
    assert expectations.in_flight(JOB) == 2
    assert expectations.done(JOB, recorded[0]) == 1 and list(expectations.pending(JOB)) == ["gpt-worker-0"]
    assert expectations.done(JOB, recorded[1]) == 0 and expectations.pending(JOB) == {}
    assert overlay([], expectations.pending(JOB), at(1)) == []


# --- the writer ----------------------------------------------------------------------------------
class Recorder:
    """The writer's three write functions, recording what they were given in order; a pod write
    may be held at a gate, or fail."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.gates: dict[str, threading.Event] = {}
        self.failing: dict[str, Exception] = {}
        self.head_gate = threading.Event()
        self.head_gate.set()

    def head(self, job: JobView, action: Action) -> None:
        self.head_gate.wait(10)
        if isinstance(action, PatchStatus) and action.status.get("refused"):
            raise JobChanged("changed")
        self.note(type(action).__name__)

    def pod(self, namespace: str, write: CreatePod | DeletePod) -> None:
        gate = self.gates.get(write.name)
        self.note(f"{type(write).__name__} {write.name} sent")
        if gate is not None:
            assert gate.wait(10)
        self.note(f"{type(write).__name__} {write.name} answered")
        if write.name in self.failing:
            raise self.failing[write.name]

    def event(self, job: JobView, event: EmitEvent) -> None:
        self.note(f"event {event.reason}")

    def note(self, text: str) -> None:
        with self.lock:
            self.log.append(text)

    def writer(self) -> JobWriter:
        return JobWriter(self.head, self.pod, self.event, head_concurrency=2, pod_concurrency=4)


def pod_manifest(rank: int) -> dict[str, Any]:
    manifest = make_pod(rank, node=None)
    manifest.pop("status")
    return manifest


class Outcomes:
    def __init__(self) -> None:
        self.head: list[Exception | None] = []
        self.done: list[Exception | None] = []
        self.finished = threading.Event()

    def on_head(self, error: Exception | None) -> None:
        self.head.append(error)

    def on_done(self, error: Exception | None) -> None:
        self.done.append(error)
        self.finished.set()


def test_no_pod_write_is_sent_before_the_status_patch_is_answered_and_none_after_a_refusal() -> None:
    recorder = Recorder()
    writer = recorder.writer()
    recorder.head_gate.clear()
    out = Outcomes()
    actions: list[Action] = [
        PatchStatus({"phase": "Restarting"}),
        EmitEvent("Normal", "Restart", ""),
        CountRestart("WorkerFailed"),
        CreatePod(pod_manifest(0)),
    ]
    held = writer.submit(make_job(), actions, out.on_head, out.on_done)
    assert held is not None and not held.done(), "the next pass waits for the status patch"
    time.sleep(0.2)
    assert recorder.log == [] and writer.expectations.in_flight(JOB) == 0
    recorder.head_gate.set()
    held.result(timeout=5)
    assert out.head == [None] and writer.expectations.in_flight(JOB) in (0, 1)
    assert out.finished.wait(5) and out.done == [None]
    assert recorder.log[:2] == ["PatchStatus", "CountRestart"], "the head in the reconciler's order"
    assert set(recorder.log[2:]) == {
        "event Restart",
        "CreatePod gpt-worker-0 sent",
        "CreatePod gpt-worker-0 answered",
    }

    refused = Recorder()
    out = Outcomes()
    held = refused.writer().submit(
        make_job(), [PatchStatus({"refused": True}), *actions[1:]], out.on_head, out.on_done
    )
    assert held is not None
    held.result(timeout=5)
    assert len(out.head) == 1 and isinstance(out.head[0], JobChanged)
    time.sleep(0.2)
    assert refused.log == [] and out.done == [], "nothing of a refused pass is done"


def test_a_pass_without_a_status_patch_is_not_held_and_its_pod_writes_are_expected_at_once() -> None:
    recorder = Recorder()
    recorder.gates["gpt-worker-1"] = threading.Event()
    writer = recorder.writer()
    out = Outcomes()
    held = writer.submit(make_job(), [CreatePod(pod_manifest(1))], out.on_head, out.on_done)
    assert held is None and out.head == [None]
    assert list(writer.expectations.pending(JOB)) == ["gpt-worker-1"]
    recorder.gates["gpt-worker-1"].set()
    assert out.finished.wait(5) and writer.expectations.pending(JOB) == {}


def test_the_first_failed_pod_write_in_the_passes_order_is_the_one_reported() -> None:
    recorder = Recorder()
    recorder.gates["gpt-worker-1"] = threading.Event()  # answered last, but given first
    recorder.failing = {
        "gpt-worker-1": ApiException(403, "Forbidden"),
        "gpt-worker-2": ApiException(500, "x"),
    }
    out = Outcomes()
    writes = [CreatePod(pod_manifest(r)) for r in range(4)]
    recorder.writer().submit(make_job(), list(writes), out.on_head, out.on_done)
    time.sleep(0.2)
    assert not out.finished.is_set(), "reported once every write of the pass is answered"
    recorder.gates["gpt-worker-1"].set()
    assert out.finished.wait(5)
    [error] = out.done
    assert isinstance(error, ActionFailed) and error.action == writes[1]
    assert isinstance(error.error, ApiException) and error.error.status == 403


def test_the_writes_of_one_pod_go_out_one_after_the_other() -> None:
    recorder = Recorder()
    recorder.gates["gpt-worker-0"] = threading.Event()
    writer = recorder.writer()
    first, second = Outcomes(), Outcomes()
    writer.submit(make_job(), [CreatePod(pod_manifest(0))], first.on_head, first.on_done)
    writer.submit(
        make_job(),
        [DeletePod("gpt-worker-0", "x"), CreatePod(pod_manifest(1))],
        second.on_head,
        second.on_done,
    )
    time.sleep(0.3)
    assert "DeletePod gpt-worker-0 sent" not in recorder.log, "sent while its creation was in flight"
    assert "CreatePod gpt-worker-1 answered" in recorder.log, "other pods' writes do not wait"
    recorder.gates["gpt-worker-0"].set()
    assert first.finished.wait(5) and second.finished.wait(5)
    order = [line for line in recorder.log if "worker-0" in line]
    assert order == [
        "CreatePod gpt-worker-0 sent",
        "CreatePod gpt-worker-0 answered",
        "DeletePod gpt-worker-0 sent",
        "DeletePod gpt-worker-0 answered",
    ]


def test_a_job_waiting_for_its_writes_to_drain_is_called_when_at_most_that_many_are_in_flight() -> None:
    recorder = Recorder()
    for r in range(3):
        recorder.gates[f"gpt-worker-{r}"] = threading.Event()
    writer = recorder.writer()
    out = Outcomes()
    writer.submit(make_job(), [CreatePod(pod_manifest(r)) for r in range(3)], out.on_head, out.on_done)
    called = threading.Event()
    writer.when_drained(JOB, 1, called.set)
    recorder.gates["gpt-worker-0"].set()
    time.sleep(0.2)
    assert not called.is_set(), "2 in flight"
    recorder.gates["gpt-worker-2"].set()
    assert called.wait(5)
    now = threading.Event()
    writer.when_drained(JOB, 1, now.set)
    assert now.is_set(), "already drained: at once"
    recorder.gates["gpt-worker-1"].set()
    assert out.finished.wait(5)


# --- the pass runner on the writer -------------------------------------------------------------------
class WritingKube:
    """A job of `replicas` workers on one node whose pods are the pod writes answered so far (the
    cache), seen through the writes in flight (the expectations), with the operator's writer. Pod
    writes wait at `gate` and fail with `fail` while it is set; the runner's own reports
    (`execute`) are recorded."""

    def __init__(self, replicas: int = 2) -> None:
        self.job = make_job(replicas=replicas, min_replicas=1, max_replicas=replicas)
        self.pods: dict[str, dict[str, Any]] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None
        self.lock = threading.Lock()
        self.sent: list[str] = []
        self.reports: list[list[Action]] = []
        self.events: list[EmitEvent] = []
        self.writer = JobWriter(self._head, self._pod, lambda job, e: self.events.append(e), 2, 8)

    def get_job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self.job)

    def observe(self, job: dict[str, Any]) -> Observed:
        with self.lock:
            cached = [self.pods[name] for name in sorted(self.pods)]
        return seen_through(job, cached, self.writer.expectations, [make_node("n1", cpu="64")])

    def submit(self, job: dict[str, Any], actions: list[Action], on_head: Outcome, on_done: Outcome) -> Any:
        return self.writer.submit(job, actions, on_head, on_done)

    def when_drained(self, job: tuple[str, str], at_most: int, fn: Callable[[], object]) -> None:
        self.writer.when_drained(job, at_most, fn)

    def execute(self, job: dict[str, Any], actions: list[Action]) -> None:
        for action in actions:
            self._head(JobView(job), action)
        self.reports.append(actions)

    def forget(self, namespace: str, name: str) -> None:
        pass

    def _head(self, job: JobView, action: Action) -> None:
        if isinstance(action, PatchStatus):
            with self.lock:
                self.job = {**self.job, "status": {**(self.job.get("status") or {}), **action.status}}

    def _pod(self, namespace: str, write: CreatePod | DeletePod) -> None:
        with self.lock:
            self.sent.append(write.name)
        assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        if isinstance(write, CreatePod):
            rank = int(env_of(write.manifest)["RANK"])
            with self.lock:
                self.pods[write.name] = make_pod(rank, phase="Pending", node=None, created=since_t0())


def since_t0() -> float:
    """Now, in the fixtures' seconds after T0 (`make_pod(created=...)`)."""
    return (datetime.now(UTC) - at(0)).total_seconds()


def test_the_next_pass_runs_while_pod_writes_are_in_flight_and_does_not_repeat_them() -> None:
    kube = WritingKube(replicas=3)
    kube.gate.clear()  # no pod write is answered until the end
    settings = OperatorSettings(trigger_delay_seconds=0, reconciler=ReconcilerSettings(pod_writes_per_pass=1))
    runner = JobPassRunner(kube, OperatorMetrics(), settings)  # type: ignore[arg-type]
    runner.trigger(*JOB)
    # pod_writes_per_pass=1: the second pass runs while the first one's creation is unanswered...
    settle(lambda: len(kube.sent) == 2)
    assert kube.sent == ["gpt-worker-0", "gpt-worker-1"] and not kube.pods
    runner.trigger(*JOB)  # a pass a pod event triggers meanwhile
    time.sleep(0.3)
    # ...and the third once the job has no more than one pass's worth in flight.
    assert len(kube.sent) == 2, "a job has at most two passes' pod writes in flight"
    kube.gate.set()
    settle(lambda: len(kube.pods) == 3)
    runner.trigger(*JOB)  # a pod event's pass: the cache holds the pods now
    time.sleep(0.3)
    assert kube.sent == ["gpt-worker-0", "gpt-worker-1", "gpt-worker-2"], "each pod created once"
    assert runner.failing_attempts(*JOB) == 0


def test_a_pod_write_failing_after_its_pass_shows_on_the_job_backs_off_and_recovers() -> None:
    kube = WritingKube(replicas=1)
    kube.fail = ApiException(403, "Forbidden")
    retry = RetrySettings(backoff_seconds=0.5, backoff_max_seconds=1)
    runner = JobPassRunner(kube, OperatorMetrics(), OperatorSettings(trigger_delay_seconds=0, retry=retry))  # type: ignore[arg-type]
    runner.trigger(*JOB)
    settle(lambda: len(kube.reports) >= 1)  # the pass after the failed write wrote the report
    assert runner.failing_attempts(*JOB) == 1
    reconciled = next(c for c in kube.job["status"]["conditions"] if c["type"] == "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "ActionFailed")
    assert reconciled["message"].startswith("creating pod gpt-worker-0: 403 Forbidden")
    assert [e.reason for e in events(kube.reports[0])] == ["ActionFailed"]
    settle(lambda: len(kube.reports) >= 2)  # retried by itself after the backoff, and failed again
    assert runner.failing_attempts(*JOB) >= 2 and not events(kube.reports[1]), "the same error: no event"
    kube.fail = None
    settle(lambda: any(e.reason == "Recovered" for r in kube.reports for e in events(r)))
    assert runner.failing_attempts(*JOB) == 0
    reconciled = next(c for c in kube.job["status"]["conditions"] if c["type"] == "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("True", "Reconciled")
    assert list(kube.pods) == ["gpt-worker-0"]


def test_a_pass_whose_status_patch_is_refused_sends_none_of_its_pod_writes() -> None:
    class Refusing(WritingKube):
        refusals = 1

        def _head(self, job: JobView, action: Action) -> None:
            if isinstance(action, PatchStatus) and self.refusals:
                self.refusals -= 1
                raise JobChanged("changed")
            super()._head(job, action)

    kube = Refusing(replicas=2)
    runner = JobPassRunner(kube, OperatorMetrics(), OperatorSettings(trigger_delay_seconds=0))  # type: ignore[arg-type]
    runner.trigger(*JOB)
    settle(lambda: len(kube.pods) == 2)
    assert sorted(kube.sent) == ["gpt-worker-0", "gpt-worker-1"], "the refused pass sent nothing"
    assert runner.failing_attempts(*JOB) == 0


def test_a_job_changed_only_in_metadata_the_reconciler_never_reads_decides_the_same() -> None:
    read = make_job(status=running_status(4))
    read["metadata"]["resourceVersion"] = "10"
    kopf = copy.deepcopy(read)
    kopf["metadata"].update(
        resourceVersion="11",
        finalizers=["training.dtjob.io/operator"],
        annotations={"kopf": "x"},
        managedFields=[{"manager": "kopf"}],
    )
    assert same_but_bookkeeping(read, kopf)
    scaled = copy.deepcopy(kopf)
    scaled["spec"]["replicas"] = 2
    deleted = copy.deepcopy(kopf)
    deleted["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    written = copy.deepcopy(kopf)
    written["status"]["restarts"] = 1
    for other in (scaled, deleted, written):
        assert not same_but_bookkeeping(read, other)


# --- progress-only status patches ---------------------------------------------------------------
def test_a_patch_that_only_moves_the_workers_progress_is_marked_so() -> None:
    job = make_job(replicas=4, min_replicas=1, max_replicas=4)
    nodes = [make_node("n1", cpu="64")]
    first = reconcile(Observed(job=job, pods=[], nodes=nodes, now=at(0)), ReconcilerSettings())
    job = {**job, "status": status_patch(first)}
    pending = [make_pod(r, phase="Pending", node=None) for r in range(4)]
    bound = plan(Observed(job=job, pods=pending, nodes=nodes, now=at(1)), ReconcilerSettings())
    assert bound.progress_only, bound.actions  # "(4 not scheduled yet)"
    job = {**job, "status": {**job["status"], **status_patch(bound.actions)}}
    some = [make_pod(r, phase="Running" if r < 2 else "Pending", node="n1") for r in range(4)]
    running = plan(Observed(job=job, pods=some, nodes=nodes, now=at(2)), ReconcilerSettings())
    assert running.progress_only and set(status_patch(running.actions)) == {"readyReplicas", "conditions"}
    everyone = [make_pod(r, phase="Running", node="n1") for r in range(4)]
    done = plan(Observed(job=job, pods=everyone, nodes=nodes, now=at(3)), ReconcilerSettings())
    assert status_patch(done.actions)["phase"] == "Running" and not done.progress_only
    created = plan(Observed(job=job, pods=some[:3], nodes=nodes, now=at(3)), ReconcilerSettings())
    assert creates(created.actions) and not created.progress_only


def test_a_progress_only_patch_waits_for_the_interval_after_the_last_and_then_is_written() -> None:
    class Stepping(WritingKube):
        """Its pods are what the test says, whatever the writes."""

        def __init__(self) -> None:
            super().__init__(replicas=2)
            self.patched: list[tuple[float, dict[str, Any]]] = []

        def _head(self, job: JobView, action: Action) -> None:
            super()._head(job, action)
            if isinstance(action, PatchStatus):
                self.patched.append((time.monotonic(), action.status))

        def _pod(self, namespace: str, write: CreatePod | DeletePod) -> None:
            pass

    kube = Stepping()
    settings = OperatorSettings(trigger_delay_seconds=0, progress_write_seconds=1.0)
    runner = JobPassRunner(kube, OperatorMetrics(), settings)  # type: ignore[arg-type]
    runner.trigger(*JOB)  # generation 0: a status patch, and two creations (kept out of the cache)
    settle(lambda: len(kube.patched) == 1)
    kube.pods = {
        f"gpt-worker-{r}": make_pod(r, phase="Pending", node=None, created=since_t0()) for r in range(2)
    }
    runner.trigger(*JOB)  # "(2 not scheduled yet)": only progress, 1 s after the last patch
    time.sleep(0.3)
    assert len(kube.patched) == 1, "a progress-only patch within the interval waits"
    kube.pods["gpt-worker-0"] = make_pod(0, phase="Running", node="n1", created=since_t0())
    runner.trigger(*JOB)
    settle(lambda: len(kube.patched) == 2, timeout=5)  # the pass at the interval's end writes it
    (first, _), (second, status) = kube.patched
    assert second - first >= 0.95 and status["readyReplicas"] == 1
    kube.pods["gpt-worker-1"] = make_pod(1, phase="Running", node="n1", created=since_t0())
    runner.trigger(*JOB)  # phase Running: written at once
    settle(lambda: len(kube.patched) == 3, timeout=0.5)
    assert kube.patched[2][1]["phase"] == "Running"


def test_a_progress_wake_up_runs_no_pass_when_a_later_patch_wrote_the_progress() -> None:
    class Stepping(WritingKube):
        def __init__(self) -> None:
            super().__init__(replicas=2)
            self.patched: list[dict[str, Any]] = []
            self.reads = 0

        def get_job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any]:
            self.reads += 1
            return super().get_job(namespace, name, fresh)

        def _head(self, job: JobView, action: Action) -> None:
            super()._head(job, action)
            if isinstance(action, PatchStatus):
                self.patched.append(action.status)

        def _pod(self, namespace: str, write: CreatePod | DeletePod) -> None:
            pass

    kube = Stepping()
    settings = OperatorSettings(trigger_delay_seconds=0, progress_write_seconds=0.5)
    runner = JobPassRunner(kube, OperatorMetrics(), settings)  # type: ignore[arg-type]
    runner.trigger(*JOB)
    settle(lambda: len(kube.patched) == 1)
    kube.pods = {
        f"gpt-worker-{r}": make_pod(r, phase="Pending", node=None, created=since_t0()) for r in range(2)
    }
    time.sleep(0.1)  # the first pass's writes are answered
    reads = kube.reads
    runner.trigger(*JOB)  # only progress: left for the wake-up at the interval's end
    settle(lambda: kube.reads > reads)
    assert len(kube.patched) == 1
    kube.pods = {
        f"gpt-worker-{r}": make_pod(r, phase="Running", node="n1", created=since_t0()) for r in range(2)
    }
    runner.trigger(*JOB)  # phase Running: written at once, with the progress
    settle(lambda: len(kube.patched) == 2)
    assert kube.patched[1]["phase"] == "Running" and kube.patched[1]["readyReplicas"] == 2
    time.sleep(0.2)  # the pass the Running phase asks for (the running gang's rules)
    reads = kube.reads
    time.sleep(0.6)  # past the progress wake-up
    assert kube.reads == reads, "the wake-up found its progress written and ran no pass"
    assert len(kube.patched) == 2


def test_a_pod_deleted_without_grace_is_not_deleted_again() -> None:
    """The answer of a forced deletion is a pod deleting with no grace period, which the API server
    has removed already; the cache holds it until its watch event comes."""
    job = make_job(status=running_status(4, generation=1))
    nodes = [make_node("n1", cpu="64")]
    failed = make_pod(1, generation=0, phase="Failed", exit_code=1, deleting=True, grace_ends=99, grace=0)
    slow = make_pod(2, generation=0, phase="Failed", exit_code=1, deleting=True, grace_ends=99, grace=5)
    decided = plan(Observed(job=job, pods=[failed, slow], nodes=nodes, now=at(100)), ReconcilerSettings())
    assert [(d.name, d.grace_seconds) for d in deletes(decided.actions)] == [("gpt-worker-2", 0)]


def test_a_job_the_cache_holds_without_kopfs_finalizer_gets_no_pass_yet() -> None:
    kube = WritingKube(replicas=1)
    settings = OperatorSettings(trigger_delay_seconds=0)
    runner = JobPassRunner(kube, OperatorMetrics(), settings, finalizer=FINALIZER)  # type: ignore[arg-type]
    runner.trigger(*JOB)
    time.sleep(0.3)
    assert "status" not in kube.job and not kube.sent, "its status patch would be refused by kopf's"
    kube.job["metadata"]["finalizers"] = [FINALIZER]  # the cache's event of kopf's patch
    runner.trigger(*JOB)
    settle(lambda: kube.sent == ["gpt-worker-0"])
    assert kube.job["status"]["phase"] == "Pending"


def test_the_event_of_the_operators_own_status_patch_needs_no_pass_but_a_gang_running_does() -> None:
    class Counting(WritingKube):
        def __init__(self) -> None:
            super().__init__(replicas=1)
            self.written: dict[tuple[str, str], str] = {}
            self.reads = 0

        def get_job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any]:
            self.reads += 1
            return super().get_job(namespace, name, fresh)

        def _head(self, job: JobView, action: Action) -> None:
            super()._head(job, action)
            if isinstance(action, PatchStatus):
                self.written[JOB] = str(len(self.written) + 10)

    kube = Counting()
    runner = JobPassRunner(kube, OperatorMetrics(), OperatorSettings(trigger_delay_seconds=0.05))  # type: ignore[arg-type]
    runner.handed(*JOB)
    runner.trigger(*JOB)  # generation 0: Pending, one creation
    settle(lambda: kube.pods != {} and kube.written != {})
    assert runner.own_status(*JOB, kube.written[JOB]) and not runner.own_status(*JOB, "9")
    time.sleep(0.3)
    reads = kube.reads
    kube.pods["gpt-worker-0"] = make_pod(0, phase="Running", node="n1", created=since_t0())
    runner.trigger(*JOB)  # the pod's event: the gang runs
    settle(lambda: kube.job["status"].get("phase") == "Running")
    settle(lambda: kube.reads == reads + 2)  # and the pass after it, on the new phase
    time.sleep(0.3)
    assert kube.reads == reads + 2
