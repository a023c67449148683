"""What the operator does differently at scale, without a cluster: capacity counts only nodes the
scheduler would use, a failing 1,024-worker gang is one short message, the watches trigger
passes only for jobs kopf handed to this operator (a paused peer acts on none) and a burst of
changes is one pass, and a pass that read an old version of its job decides again."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from dtjob.operator import manifests
from dtjob.operator.actions import DeletePod, PatchStatus
from dtjob.operator.capacity import node_admits, workers_that_fit
from dtjob.operator.expectations import overlay
from dtjob.operator.jobview import JobView
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.observed import Observed, WorkerCache
from dtjob.operator.passes import JobPassRunner
from dtjob.operator.reconciler import plan, reconcile
from dtjob.operator.settings import OperatorSettings, ReconcilerSettings
from dtjob.operator.writer import JobChanged, JobWriter, Outcome
from tests.unit.reconciler_fixtures import (
    at,
    creates,
    deletes,
    env_of,
    events,
    make_job,
    make_node,
    make_pod,
    run,
    running_status,
    seen_through,
    settle,
    status_patch,
)

TAINT = {"key": "gpu", "value": "a100", "effect": "NoSchedule"}


def template(**spec: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "trainer", "resources": {"requests": {"cpu": "1"}}}], **spec}}


def node(
    name: str, labels: dict[str, str] | None = None, taints: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    n = make_node(name, cpu="4")
    n["metadata"]["labels"] = labels or {}
    n["spec"]["taints"] = taints or []
    return n


def test_capacity_counts_only_nodes_whose_taints_the_workers_tolerate() -> None:
    tainted = node("gpu-1", taints=[TAINT])
    soft = node("soft-1", taints=[{"key": "x", "effect": "PreferNoSchedule"}])
    assert workers_that_fit("gpt", template(), [tainted, soft], []) == 4, (
        "PreferNoSchedule does not keep pods off"
    )
    for toleration in (
        {"key": "gpu", "operator": "Equal", "value": "a100", "effect": "NoSchedule"},
        {"key": "gpu", "operator": "Exists"},
        {"operator": "Exists"},
    ):
        assert node_admits(template(tolerations=[toleration]), tainted), toleration
    for toleration in (
        {"key": "gpu", "operator": "Equal", "value": "h100"},
        {"key": "gpu", "operator": "Exists", "effect": "NoExecute"},
        {"key": "other", "operator": "Exists"},
    ):
        assert not node_admits(template(tolerations=[toleration]), tainted), toleration


def test_capacity_counts_only_nodes_the_selector_and_required_affinity_match() -> None:
    a = node("a", labels={"pool": "train", "gen": "3"})
    b = node("b", labels={"pool": "serve"})
    assert workers_that_fit("gpt", template(nodeSelector={"pool": "train"}), [a, b], []) == 4

    def required(*expressions: dict[str, Any], fields: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        term: dict[str, Any] = {"matchExpressions": list(expressions)}
        if fields:
            term["matchFields"] = fields
        return {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
        }

    cases = [
        (required({"key": "pool", "operator": "In", "values": ["train", "x"]}), ["a"]),
        (required({"key": "pool", "operator": "NotIn", "values": ["train"]}), ["b"]),
        (required({"key": "gen", "operator": "Exists"}), ["a"]),
        (required({"key": "gen", "operator": "DoesNotExist"}), ["b"]),
        (required({"key": "gen", "operator": "Gt", "values": ["2"]}), ["a"]),
        (required(fields=[{"key": "metadata.name", "operator": "In", "values": ["b"]}]), ["b"]),
    ]
    for affinity, admitted in cases:
        assert [
            n["metadata"]["name"] for n in (a, b) if node_admits(template(affinity=affinity), n)
        ] == admitted


def test_a_whole_gang_failing_at_once_is_one_short_message() -> None:
    size = 1024
    job = make_job(replicas=size, min_replicas=size, max_replicas=size, status=running_status(size))
    pods = [make_pod(r, phase="Failed", exit_code=1, node=f"n{r % 128}") for r in range(size)]
    nodes = [make_node(f"n{i}", cpu="16") for i in range(128)]
    actions = run(job, pods, nodes)
    patch = status_patch(actions)
    assert patch["phase"] == "Restarting" and patch["restarts"] == 1
    [event] = [e for e in events(actions) if e.reason == "WorkerFailed"]
    assert event.message.endswith("gpt-worker-2 failed (exit code 1); and 1021 more")
    assert event.message.startswith("generation 1 with 1024 workers: gpt-worker-0 failed (exit code 1); ")
    assert len(event.message) < 200


class FakeKube:
    def __init__(self) -> None:
        self.passes: list[tuple[str, str]] = []
        self.done = threading.Semaphore(0)

    def get_job(self, namespace: str, name: str) -> None:
        self.passes.append((namespace, name))
        self.done.release()
        return None  # gone: the runner forgets it

    def forget(self, namespace: str, name: str) -> None:
        pass


def test_watches_trigger_passes_only_for_jobs_kopf_handed_over_lately() -> None:
    now = [0.0]
    kube = FakeKube()
    settings = OperatorSettings(interval_seconds=5)
    runner = JobPassRunner(kube, OperatorMetrics(), settings, clock=lambda: now[0])  # type: ignore[arg-type]
    runner.trigger_soon("ns", "gpt")
    assert not kube.done.acquire(timeout=0.5), "kopf never handed it over (a paused peer)"
    runner.handed("ns", "gpt")
    runner.trigger_soon("ns", "gpt")
    assert kube.done.acquire(timeout=5) and kube.passes == [("ns", "gpt")]
    runner.handed("ns", "gpt")  # the pass forgot the job (gone); kopf hands it over again
    now[0] = 10.9  # within two timer intervals and a second
    runner.trigger_soon("ns", "gpt")
    assert kube.done.acquire(timeout=5)
    runner.handed("ns", "gpt")
    now[0] = 10.9 + 11.5  # kopf's timer stopped calling (paused by its peering)
    runner.trigger_soon("ns", "gpt")
    assert not kube.done.acquire(timeout=0.5)
    assert len(kube.passes) == 2


class PlainKube:
    """A job that is there, on one node, and whose first `conflicts` status patches are refused
    (it changed after the pass read it). Its passes' actions go through the operator's writer."""

    def __init__(self, conflicts: int = 0) -> None:
        self.executed: list[list[Any]] = []  # the actions of each pass whose status patch went through
        self.conflicts = conflicts
        self.passes: list[str] = []
        self.done = threading.Semaphore(0)
        self.writer = JobWriter(self._head, self._pod, lambda job, event: None, 2, 4)

    def get_job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any]:
        self.passes.append(name)
        self.done.release()
        return make_job(replicas=2, min_replicas=1, max_replicas=2)

    def observe(self, job: dict[str, Any]) -> Observed:
        return Observed(job=job, pods=[], nodes=[make_node("n1", cpu="8")], now=datetime.now(UTC))

    def submit(self, job: dict[str, Any], actions: list[Any], on_head: Outcome, on_done: Outcome) -> Any:
        def recorded(error: Exception | None) -> None:
            if error is None:
                self.executed.append(actions)
            on_head(error)

        return self.writer.submit(job, actions, recorded, on_done)

    def when_drained(self, job: tuple[str, str], at_most: int, fn: Callable[[], object]) -> None:
        self.writer.when_drained(job, at_most, fn)

    def _head(self, job: JobView, action: Any) -> None:
        if isinstance(action, PatchStatus) and self.conflicts:
            self.conflicts -= 1
            raise JobChanged("ns/gpt changed since the pass read it")

    def _pod(self, namespace: str, write: Any) -> None:
        pass


def test_a_pass_whose_job_changed_before_its_status_patch_decides_again_without_an_error() -> None:
    kube = PlainKube(conflicts=1)
    runner = JobPassRunner(kube, OperatorMetrics(), OperatorSettings())  # type: ignore[arg-type]
    runner.trigger("ns", "gpt")
    settle(lambda: len(kube.executed) == 1)
    assert kube.passes == ["gpt", "gpt"], "the pass ran again at once"
    assert isinstance(kube.executed[0][0], PatchStatus) and kube.executed[0][0].status["phase"] == "Pending"
    assert runner.failing_attempts("ns", "gpt") == 0, "a changed job is no error"


def test_the_changes_of_a_burst_within_the_trigger_delay_are_one_pass() -> None:
    kube = PlainKube()
    runner = JobPassRunner(kube, OperatorMetrics(), OperatorSettings(trigger_delay_seconds=2))  # type: ignore[arg-type]
    runner.handed("ns", "gpt")
    runner.handed("ns", "bert")
    for _ in range(6):  # the pods of a gang changing one after the other
        runner.trigger_soon("ns", "gpt")
        time.sleep(0.05)
    runner.trigger_soon("ns", "bert")
    assert kube.done.acquire(timeout=10) and kube.done.acquire(timeout=10)
    assert not kube.done.acquire(timeout=1), "one pass per job for the whole burst"
    assert sorted(kube.passes) == ["bert", "gpt"]


def test_an_urgent_trigger_skips_the_delay_and_the_burst_after_it_still_waits() -> None:
    kube = PlainKube()
    runner = JobPassRunner(kube, OperatorMetrics(), OperatorSettings(trigger_delay_seconds=2))  # type: ignore[arg-type]
    runner.trigger_soon("ns", "bert", urgent=True)
    runner.handed("ns", "gpt")
    runner.trigger_soon("ns", "gpt")  # a pod changed: waits the delay
    runner.trigger_soon("ns", "gpt", urgent=True)  # a worker failed: at once
    assert kube.done.acquire(timeout=1), "the urgent trigger ran its pass within the 2 s delay"
    assert kube.passes == ["gpt"], "a job kopf did not hand over gets no pass, urgent or not"
    runner.trigger_soon("ns", "gpt")  # the burst after the failure joins the queued trigger
    assert not kube.done.acquire(timeout=1), "the delayed trigger waits its 2 s"
    assert kube.done.acquire(timeout=5) and not kube.done.acquire(timeout=0.5)
    assert kube.passes == ["gpt", "gpt"]


class RememberingKube(PlainKube):
    """PlainKube whose job keeps the status its passes patch (a job with `run_policy`)."""

    def __init__(self, run_policy: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.job = make_job(replicas=2, min_replicas=1, max_replicas=2, runPolicy=run_policy or {})

    def get_job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any]:
        super().get_job(namespace, name, fresh)
        return self.job

    def _head(self, job: JobView, action: Any) -> None:
        super()._head(job, action)
        if isinstance(action, PatchStatus):
            self.job = {**self.job, "status": {**(self.job.get("status") or {}), **action.status}}


def test_a_tick_runs_a_pass_only_when_one_is_due() -> None:
    now = [0.0]
    kube = RememberingKube()
    settings = OperatorSettings(trigger_delay_seconds=0, interval_seconds=5, resync_seconds=60)
    runner = JobPassRunner(kube, OperatorMetrics(), settings, clock=lambda: now[0])  # type: ignore[arg-type]
    runner.tick("ns", "gpt")
    assert kube.done.acquire(timeout=5), "a job without a pass yet gets one at its first tick"
    settle(lambda: len(kube.executed) == 1)  # its status patch answered: the pass is over
    for t in (5.0, 10.0, 55.0):  # waiting for its workers: only their pods' events change that
        now[0] = t
        runner.tick("ns", "gpt")
    assert not kube.done.acquire(timeout=0.5), f"ticks ran passes nobody needed: {kube.passes}"
    now[0] = 60.5
    runner.tick("ns", "gpt")
    assert kube.done.acquire(timeout=5), "resync_seconds after the last pass, a tick runs one"


def test_a_deadline_the_last_pass_named_gets_a_pass_of_its_own_when_it_falls_due() -> None:
    kube = RememberingKube({"activeDeadlineSeconds": 1})
    runner = JobPassRunner(kube, OperatorMetrics(), OperatorSettings(trigger_delay_seconds=0))  # type: ignore[arg-type]
    runner.handed("ns", "gpt")
    runner.trigger("ns", "gpt")  # starts the job: startTime now (to the second), deadline 1 s later
    assert kube.done.acquire(timeout=5)
    assert kube.done.acquire(timeout=5), "no pass at the deadline, though nothing else would come"
    settle(lambda: len(kube.executed) == 2)  # the pass at the deadline wrote its status
    phase = (kube.job.get("status") or {}).get("phase")
    assert phase == "Failed", f"the pass at the deadline failed the job: {phase}"
    assert not kube.done.acquire(timeout=1.5), "a failed job without a TTL wants no more passes"


def test_a_big_gang_is_created_and_deleted_a_bounded_number_of_pods_per_pass() -> None:
    settings = ReconcilerSettings(pod_writes_per_pass=96)
    job = make_job(replicas=200, min_replicas=1, max_replicas=200, cpu="100m")
    nodes = [make_node(f"n{i}", cpu="64") for i in range(4)]
    status = status_patch(reconcile(Observed(job=job, pods=[], nodes=nodes, now=at(0)), settings))
    job = {**job, "status": status}
    pods: list[dict[str, Any]] = []
    made: list[int] = []
    while True:
        decided = plan(Observed(job=job, pods=pods, nodes=nodes, now=at(1)), settings)
        ranks = [int(env_of(c.manifest)["RANK"]) for c in creates(decided.actions)]
        made.append(len(ranks))
        pods += [make_pod(r, phase="Pending", node=None) for r in ranks]
        if not decided.more:
            break
    assert made == [96, 96, 8]
    assert sorted(int(p["metadata"]["labels"]["training.dtjob.io/rank"]) for p in pods) == list(range(200))
    # A failed worker: the 200 others are deleted 96 a pass, the first pass also starts generation 1.
    running = [make_pod(r, phase="Running", node=f"n{r % 4}") for r in range(200)]
    running[7] = make_pod(7, phase="Failed", node="n3", exit_code=1)
    first = plan(Observed(job=job, pods=running, nodes=nodes, now=at(2)), settings)
    assert status_patch(first.actions)["generation"] == 1 and first.more
    assert len(deletes(first.actions)) == 96 and not creates(first.actions)


class PodsKube(RememberingKube):
    """RememberingKube whose pod creations show once answered, as the cache's assumed answers
    do, and before as the writer's expectations."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: list[dict[str, Any]] = []

    def observe(self, job: dict[str, Any]) -> Observed:
        return seen_through(job, list(self.pods), self.writer.expectations, [make_node("n1", cpu="8")])

    def _pod(self, namespace: str, write: Any) -> None:
        self.pods.append(make_pod(int(env_of(write.manifest)["RANK"]), phase="Pending", node=None))


def test_a_pass_that_left_pod_writes_over_is_followed_by_the_next_at_once() -> None:
    kube = PodsKube()
    settings = OperatorSettings(trigger_delay_seconds=0, reconciler=ReconcilerSettings(pod_writes_per_pass=1))
    runner = JobPassRunner(kube, OperatorMetrics(), settings)  # type: ignore[arg-type]
    runner.trigger("ml", "gpt")  # one trigger: the next pass follows on the runner's threads
    settle(lambda: len(kube.pods) == 2)
    assert [len(creates(a)) for a in kube.executed] == [1, 1], kube.executed
    assert sorted(env_of(c.manifest)["RANK"] for a in kube.executed for c in creates(a)) == ["0", "1"]


def test_a_pass_builds_only_the_pod_manifests_it_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    worker_pod = manifests.worker_pod

    def counted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        built.append(args[1])
        return worker_pod(*args, **kwargs)

    monkeypatch.setattr(manifests, "worker_pod", counted)
    settings = ReconcilerSettings(pod_writes_per_pass=96)
    job = make_job(replicas=1024, min_replicas=1, max_replicas=1024, cpu="100m")
    nodes = [make_node(f"n{i}", cpu="64") for i in range(4)]
    started = status_patch(reconcile(Observed(job=job, pods=[], nodes=nodes, now=at(0)), settings))
    built.clear()  # the first pass creates generation 0's first pods already
    decided = plan(Observed(job={**job, "status": started}, pods=[], nodes=nodes, now=at(1)), settings)
    assert len(creates(decided.actions)) == 96 and decided.more
    assert built == list(range(96)), "1,024 manifests built for 96 creations"


def test_a_versioned_pod_is_parsed_once_and_its_deletion_in_flight_is_seen() -> None:
    workers = WorkerCache()
    pod = make_pod(3, phase="Running", node="n1")
    pod["metadata"].update(uid="u-3", resourceVersion="41")
    first = workers.of(pod)
    assert workers.of(copy.deepcopy(pod)) is first, "parsed once per resourceVersion"
    [deleting] = overlay([pod], {"gpt-worker-3": [DeletePod("gpt-worker-3", "x", grace_seconds=1)]}, at(5))
    assert workers.of(deleting).deleting and not first.deleting
    newer = copy.deepcopy(pod)
    newer["metadata"]["resourceVersion"] = "42"
    newer["status"]["phase"] = "Failed"
    assert workers.of(newer).phase == "Failed"
    unversioned = make_pod(3, phase="Pending", node=None)
    assert workers.of(unversioned) is not workers.of(unversioned), "no version: parsed each time"
