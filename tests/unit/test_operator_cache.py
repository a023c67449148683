"""The operator's watch-based caches without a cluster: a list then watch events from a fake API,
the operator's own writes put in ahead of the watch, and which jobs a change triggers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from dtjob.operator.actions import CreatePod
from dtjob.operator.cache import ClusterCache, Informer, ReadOnFirstUse, trim_pod
from dtjob.operator.expectations import Expectations
from dtjob.operator.jobview import LABEL_GENERATION, LABEL_JOB
from dtjob.operator.kube import request_kind


def pod(
    name: str,
    rv: int,
    job: str | None = "gpt",
    node: str | None = None,
    phase: str = "Pending",
    namespace: str = "ns",
    deleting: bool = False,
    generation: int = 0,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{name}",
        "resourceVersion": str(rv),
        "labels": {LABEL_JOB: job, LABEL_GENERATION: str(generation)} if job else {},
        "managedFields": [{"manager": "x"}],
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    container = {
        "name": "trainer",
        "env": [{"name": "RANK", "value": "0"}] * 20,
        "resources": {"requests": {"cpu": "1"}},
    }
    spec: dict[str, Any] = {"containers": [container], "volumes": [{"name": "v"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def node(name: str, ready: bool, rv: int = 1) -> dict[str, Any]:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    return {"metadata": {"name": name, "resourceVersion": str(rv)}, "status": {"conditions": [condition]}}


class FakeApi:
    """Answers the informer's list with `listed` and its watch with `events`, then ends the watch
    (the informer would go on with another)."""

    def __init__(self, listed: list[dict[str, Any]], events: list[dict[str, Any]], rv: str = "100") -> None:
        self.listed, self.events, self.rv = listed, events, rv
        self.watched = threading.Event()
        self.queries: list[dict[str, Any]] = []

    def call(self, method: str, path: str, query: Any = None, **_: Any) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": self.rv}, "items": self.listed}

    def watch(
        self, path: str, query: dict[str, Any], timeout: Any = None
    ) -> tuple[Any, Iterator[dict[str, Any]]]:
        self.queries.append(query)

        def events() -> Iterator[dict[str, Any]]:
            yield from self.events
            self.events = []
            self.watched.set()
            threading.Event().wait(3600)
            yield from ()

        class Response:
            def close(self) -> None:
                pass

        return Response(), events()


def test_an_informer_lists_then_follows_the_watch_and_trims_what_no_pass_reads() -> None:
    events = [
        {"type": "ADDED", "object": pod("gpt-worker-1", 101)},
        {"type": "MODIFIED", "object": pod("gpt-worker-0", 102, node="n1", phase="Running")},
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "103"}}},
        {"type": "DELETED", "object": pod("other-0", 104, job="other")},
    ]
    api = FakeApi([pod("gpt-worker-0", 90), pod("other-0", 91, job="other")], events)
    changes: list[tuple[Any, Any]] = []
    informer = Informer(
        api, "pods", "/api/v1/pods", trim=trim_pod, on_change=lambda a, b: changes.append((a, b))
    )  # type: ignore[arg-type]
    informer.start()
    assert informer.synced.wait(10) and api.watched.wait(10)
    names = sorted(p["metadata"]["name"] for p in informer.items())
    assert names == ["gpt-worker-0", "gpt-worker-1"]
    cached = informer.get(("ns", "gpt-worker-0"))
    assert cached is not None and cached["status"]["phase"] == "Running"
    assert "managedFields" not in cached["metadata"] and "volumes" not in cached["spec"]
    assert cached["spec"]["containers"] == [{"name": "trainer", "resources": {"requests": {"cpu": "1"}}}]
    assert api.queries[0]["resourceVersion"] == "100" and api.queries[0]["allowWatchBookmarks"] == "true"
    assert len(changes) == 3, "the first list triggers nothing (kopf hands every job over at start)"
    informer.stop()


def test_the_operators_own_writes_are_never_undone_by_an_older_watch_event() -> None:
    informer = Informer(FakeApi([], []), "pods", "/api/v1/pods", trim=trim_pod)  # type: ignore[arg-type]
    informer._replace([], 10)
    informer.assume(pod("gpt-worker-0", 20, deleting=True))  # the response of our delete
    informer._apply("MODIFIED", pod("gpt-worker-0", 15, node="n1", phase="Running"))  # the watch lags
    cached = informer.get(("ns", "gpt-worker-0"))
    assert cached is not None and "deletionTimestamp" in cached["metadata"]
    informer._apply("DELETED", pod("gpt-worker-0", 21))
    assert informer.get(("ns", "gpt-worker-0")) is None
    # A new pod of the same name created before the old one's DELETED event arrives stays.
    informer.assume(pod("gpt-worker-1", 40))
    informer._apply("DELETED", pod("gpt-worker-1", 30))
    assert informer.get(("ns", "gpt-worker-1")) is not None
    # A relist keeps what the cache holds newer than the list, and drops what the list lacks.
    informer.assume(pod("gpt-worker-2", 60))
    informer._replace([pod("gpt-worker-1", 35)], 50)
    assert sorted(p["metadata"]["name"] for p in informer.items()) == ["gpt-worker-1", "gpt-worker-2"]
    assert informer.get(("ns", "gpt-worker-1"))["metadata"]["resourceVersion"] == "40"  # type: ignore[index]
    informer._replace([], 70)
    assert informer.items() == []


def test_the_response_of_a_delete_after_its_deleted_event_does_not_bring_the_pod_back() -> None:
    informer = Informer(FakeApi([], []), "pods", "/api/v1/pods", trim=trim_pod)  # type: ignore[arg-type]
    informer._replace([pod("gpt-worker-0", 10, node="n1", phase="Running")], 10)
    informer._apply("DELETED", pod("gpt-worker-0", 21))  # the watch is faster than the response
    informer.assume(pod("gpt-worker-0", 21, deleting=True))  # our force delete's response
    informer.assume(pod("gpt-worker-0", 20, deleting=True))  # or an older one
    assert informer.get(("ns", "gpt-worker-0")) is None
    # Gone from a relist (its DELETED missed): a response older than the list stays out too.
    informer._replace([pod("gpt-worker-1", 30)], 30)
    informer._replace([], 40)
    informer.assume(pod("gpt-worker-1", 35, deleting=True))
    assert informer.items() == []
    # The next pod of that name, created after, is cached.
    informer.assume(pod("gpt-worker-0", 50))
    assert informer.get(("ns", "gpt-worker-0")) is not None


def test_pod_changes_trigger_their_job_and_a_lost_node_the_jobs_on_it() -> None:
    cache = ClusterCache(None, ("ns",))  # type: ignore[arg-type]
    fired: list[tuple[str, str]] = []
    cache.trigger = lambda ns, name, urgent=False: fired.append((ns, name))
    pods = Informer(
        None,
        "pods",
        "/api/v1/pods",
        trim=trim_pod,  # type: ignore[arg-type]
        indexes={"job": lambda p: _job(p), "node": lambda p: [p["spec"].get("nodeName")]},
        on_change=cache._pod_changed,
    )
    cache.pods = [pods]
    pods._replace([pod("gpt-worker-0", 1, node="n1"), pod("bert-worker-0", 2, job="bert", node="n2")], 2)
    pods._apply("MODIFIED", pod("gpt-worker-0", 3, node="n1", phase="Running"))
    pods._apply("ADDED", pod("x-worker-0", 4, job="x", namespace="not-served"))
    pods._apply("ADDED", pod("plain", 5, job=None))
    assert fired == [("ns", "gpt")], "only served namespaces, only labelled pods"
    fired.clear()
    cache._node_changed(node("n2", True), node("n2", True, rv=2))  # a heartbeat
    cache._node_changed(None, node("n3", False))
    assert fired == []
    cache._node_changed(node("n2", True), node("n2", False, rv=3))
    assert fired == [("ns", "bert")]
    cache._node_changed(node("n1", True), None)
    assert fired == [("ns", "bert"), ("ns", "gpt")]
    assert [p["metadata"]["name"] for p in cache.job_pods("ns", "gpt")] == ["gpt-worker-0"]
    assert len(cache.bound_pods()) == 2


def test_bound_pods_are_read_at_first_use_and_kept() -> None:
    reads: list[int] = []

    def read() -> list[dict[str, object]]:
        reads.append(1)
        return [{"n": len(reads)}]

    pods = ReadOnFirstUse(read)  # type: ignore[arg-type]
    assert reads == [], "nothing read before first use"
    assert list(pods) == [{"n": 1}] and pods[0] == {"n": 1} and len(pods) == 1 and pods[:1] == [{"n": 1}]
    assert reads == [1], "one snapshot, read once"


def test_a_worker_failing_and_the_last_pod_of_its_generation_gone_are_urgent_triggers() -> None:
    cache = ClusterCache(None, ("ns",))  # type: ignore[arg-type]
    fired: list[tuple[str, bool]] = []
    cache.trigger = lambda ns, name, urgent=False: fired.append((name, urgent))
    pods = Informer(
        None,
        "pods",
        "/api/v1/pods",
        trim=trim_pod,  # type: ignore[arg-type]
        indexes={"job": _job},
        on_change=cache._pod_changed,
    )
    cache.pods = [pods]
    pods._replace([pod(f"gpt-worker-{r}", 1 + r, phase="Running") for r in range(2)], 2)
    pods._apply("MODIFIED", pod("gpt-worker-0", 3, phase="Failed"))
    pods._apply("MODIFIED", pod("gpt-worker-0", 4, phase="Failed"))  # its status again
    assert fired == [("gpt", True), ("gpt", False)], "the failure once, not its repeats"
    fired.clear()
    pods._apply("MODIFIED", pod("gpt-worker-1", 5, phase="Failed", deleting=True))  # the restart's
    pods._apply("DELETED", pod("gpt-worker-0", 6, phase="Failed"))
    pods._apply("ADDED", pod("gpt-worker-0", 7, generation=1))  # another generation's pod
    assert fired == [("gpt", False)] * 3, "a pod of generation 0 is left"
    fired.clear()
    pods._apply("DELETED", pod("gpt-worker-1", 8, phase="Failed", deleting=True))
    assert fired == [("gpt", True)], "generation 0 is gone: its pass creates generation 1"


def test_a_new_pod_whose_creation_is_in_flight_triggers_nothing() -> None:
    cache = ClusterCache(None, ("ns",))  # type: ignore[arg-type]
    fired: list[str] = []
    cache.trigger = lambda ns, name, urgent=False: fired.append(name)
    expectations = Expectations()
    cache.creating = lambda ns, job, name: expectations.creating((ns, job), name)
    pods = Informer(
        None,
        "pods",
        "/api/v1/pods",
        trim=trim_pod,  # type: ignore[arg-type]
        indexes={"job": _job},
        on_change=cache._pod_changed,
    )
    cache.pods = [pods]
    manifest = {"metadata": {"name": "gpt-worker-0"}}
    (created,) = expectations.expect(("ns", "gpt"), [CreatePod(manifest)])
    pods._apply("ADDED", pod("gpt-worker-0", 1))
    assert fired == [], "the pass that created it saw it so already"
    pods._apply("ADDED", pod("gpt-worker-1", 2))
    assert fired == ["gpt"], "a pod the operator is not creating"
    pods._apply("MODIFIED", pod("gpt-worker-0", 3, node="n1"))
    assert fired == ["gpt"] * 2, "its binding is news"
    pods._apply("DELETED", pod("gpt-worker-0", 4, node="n1"))
    pods._apply("ADDED", pod("gpt-worker-0", 5, node="n1", phase="Running"))
    assert fired == ["gpt"] * 4, "a pod already bound is more than its creation said"
    expectations.done(("ns", "gpt"), created)
    pods._apply("DELETED", pod("gpt-worker-0", 6, node="n1"))
    pods._apply("ADDED", pod("gpt-worker-0", 7))
    assert fired == ["gpt"] * 6, "no creation in flight any more"


def _job(p: dict[str, Any]) -> list[tuple[str, str]]:
    job = p["metadata"]["labels"].get(LABEL_JOB)
    return [(p["metadata"]["namespace"], job)] if job else []


def test_requests_are_counted_by_kubernetes_verb_and_resource() -> None:
    base = "https://127.0.0.1:6443"
    assert request_kind("GET", f"{base}/api/v1/pods?watch=true&resourceVersion=5") == ("watch", "pods")
    assert request_kind("GET", f"{base}/api/v1/nodes") == ("list", "nodes")
    assert request_kind("POST", f"{base}/api/v1/namespaces/ns/pods") == ("create", "pods")
    assert request_kind("DELETE", f"{base}/api/v1/namespaces/ns/pods/p-0?gracePeriodSeconds=0") == (
        "delete",
        "pods",
    )
    assert request_kind("GET", f"{base}/api/v1/namespaces/ns/pods/p-0/log") == ("get", "pods/log")
    job = f"{base}/apis/training.dtjob.io/v1alpha1/namespaces/ns/distributedtrainingjobs/j"
    assert request_kind("GET", job) == ("get", "distributedtrainingjobs")
    assert request_kind("PATCH", f"{job}/status") == ("patch", "distributedtrainingjobs/status")
    assert request_kind("GET", f"{base}/api/v1/namespaces/ns") == ("get", "namespaces")


def job(rv: int, replicas: int = 2, status: dict[str, Any] | None = None) -> dict[str, Any]:
    meta = {"name": "gpt", "namespace": "ns", "uid": "uid-gpt", "resourceVersion": str(rv)}
    return {"metadata": meta, "spec": {"replicas": replicas}, "status": status or {}}


def test_the_job_a_pass_reads_holds_the_status_the_operator_wrote_and_its_echo_triggers_nothing() -> None:
    cache = ClusterCache(None, ("ns",))  # type: ignore[arg-type]
    fired: list[tuple[str, str]] = []
    cache.trigger = lambda ns, name, urgent=False: fired.append((ns, name))
    path = "/apis/training.dtjob.io/v1alpha1/namespaces/ns/distributedtrainingjobs"
    jobs = Informer(None, "jobs in ns", path, on_change=cache._job_changed)  # type: ignore[arg-type]
    cache.jobs = [jobs]
    assert cache.job("ns", "gpt") is None, "not listed yet: the pass reads the job from the API server"
    jobs._replace([job(1)], 1)
    assert cache.job("ns", "gpt") == job(1)
    jobs._apply("ADDED", {**job(2), "metadata": {**job(2)["metadata"], "name": "new"}})
    assert fired == [], "a new job's first pass comes from kopf's event, after its finalizer"
    cache.assume_job(job(5, status={"generation": 1}))  # the response of a status patch
    jobs._apply("MODIFIED", job(4, status={}))  # the watch lags
    jobs._apply("MODIFIED", job(5, status={"generation": 1}))  # the watch's echo of the patch
    assert cache.job("ns", "gpt") == job(5, status={"generation": 1})
    assert fired == [], "a status the operator wrote triggers no pass of its own"
    jobs._apply("MODIFIED", job(6, replicas=3, status={"generation": 1}))  # kubectl scale
    assert fired == [("ns", "gpt")]
    jobs._apply("DELETED", job(7, replicas=3))
    assert cache.job("ns", "gpt") is None and fired == [("ns", "gpt")] * 2
    assert cache.job("other", "gpt") is None, "a namespace no cache covers"
