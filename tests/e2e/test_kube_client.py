"""The operator's Kubernetes client (Kube) and its pass runner (JobPassRunner), in this process,
against the devcluster's real API server: no operator process, no kopf.

Kube: what `observe` sees of a job's world, that every action of `execute` does what it says and
tolerates a repeat, and that a refused action names itself. JobPassRunner: a failing pass shows
on the job (event, condition), retries by itself with backoff while other triggers wait, and
recovers once the cause is gone.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import config

from dtjob.operator.actions import CreatePod, CreateService, DeletePod, EmitEvent, PatchStatus
from dtjob.operator.jobview import JobView
from dtjob.operator.kube import Kube
from dtjob.operator.manifests import headless_service, worker_pod
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.passes import JobPassRunner
from dtjob.operator.settings import ObserverSettings, OperatorSettings, RetrySettings
from dtjob.operator.worker_defaults import WorkerDefaults
from dtjob.operator.writer import ActionFailed, JobChanged
from tests.e2e.conftest import Devcluster, kubectl, kubectl_json, wait_for
from tests.e2e.operator_harness import ensure_crd

pytestmark = pytest.mark.e2e
SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]


@pytest.fixture(scope="module")
def namespace(devcluster: Devcluster) -> Iterator[str]:
    ensure_crd()
    # kubernetes.config read $KUBECONFIG when it was imported, before the fixture set it
    config.load_kube_config(config_file=str(devcluster.kubeconfig))
    name = f"kube-client-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name, check=True)
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


def make_job(namespace: str, name: str, resources: dict[str, Any] | None = None) -> dict[str, Any]:
    """Creates a job (nobody reconciles it but the test) and returns it as the API server has it."""
    trainer = {
        "name": "trainer",
        "image": "dtjob/trainer:0.1.0",
        "command": SLEEPER,
        "resources": resources or {"requests": {"cpu": "100m"}},
    }
    manifest = {
        "apiVersion": "training.dtjob.io/v1alpha1",
        "kind": "DistributedTrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "template": {
                "spec": {"containers": [trainer], "securityContext": {"runAsUser": 0, "runAsNonRoot": False}}
            },
        },
    }
    kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=True)
    return dict(kubectl_json("get", "dtj", name, "-n", namespace))


def job_events(namespace: str, name: str) -> list[dict[str, Any]]:
    listed = kubectl_json("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    return list(listed["items"])


def conditions(namespace: str, name: str) -> dict[str, dict[str, Any]]:
    job = kubectl_json("get", "dtj", name, "-n", namespace)
    return {c["type"]: c for c in (job.get("status") or {}).get("conditions") or []}


# --- Kube ------------------------------------------------------------------------------------------
def test_observe_and_execute_on_a_real_api_server(namespace: str) -> None:
    kube = Kube(OperatorMetrics(), ObserverSettings())
    job = make_job(namespace, "observed", {"requests": {"cpu": "100m"}, "limits": {"nvidia.com/gpu": 1}})
    got = kube.get_job(namespace, "observed") or {}
    assert (got["metadata"]["uid"], got["spec"]) == (job["metadata"]["uid"], job["spec"])
    assert kube.get_job(namespace, "absent") is None
    seen = kube.observe(job)
    assert (seen.pods, seen.service_exists, seen.progress) == ([], False, None)
    assert len(seen.nodes) >= 1 and all("allocatable" in n["status"] for n in seen.nodes)

    view = JobView(job)
    pod = worker_pod(view, rank=0, world_size=1, generation=0, defaults=WorkerDefaults())
    actions = [
        PatchStatus({"phase": "Pending", "generation": 0, "replicas": 1}),
        EmitEvent("Normal", "Created", "generation 0"),
        CreateService(headless_service(view)),
        CreatePod(pod),
    ]
    kube.execute(job, actions)
    kube.execute(job, actions[1:])  # a repeat is no error: AlreadyExists is tolerated
    created = kubectl_json("get", "pod", "observed-worker-0", "-n", namespace)
    assert created["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert [e["reason"] for e in job_events(namespace, "observed")] == ["Created", "Created"]
    job = dict(kubectl_json("get", "dtj", "observed", "-n", namespace))
    assert job["status"]["phase"] == "Pending"

    # A pod with the job's label that another owner controls is not the job's.
    stray = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "stray", "labels": {"training.dtjob.io/job-name": "observed"}},
        "spec": {"containers": [{"name": "x", "image": "x", "command": SLEEPER}]},
    }
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(stray), check=True)
    seen = kube.observe(job)
    assert [p["metadata"]["name"] for p in seen.pods] == ["observed-worker-0"] and seen.service_exists

    kube.execute(job, [DeletePod("observed-worker-0", "test", grace_seconds=0)])
    kube.execute(job, [DeletePod("observed-worker-0", "test", grace_seconds=0)])  # NotFound tolerated
    wait_for("the pod to go", lambda: not kube.observe(job).pods, timeout=30)


def test_a_status_patch_over_an_old_version_goes_through_kopfs_bookkeeping_only(namespace: str) -> None:
    """The patch carries the resourceVersion the pass read: a job annotated (kopf's bookkeeping)
    since then takes it over the new version, a job whose spec changed refuses it."""
    kube = Kube(OperatorMetrics(), ObserverSettings())
    job = make_job(namespace, "stale")
    kubectl("annotate", "dtj", "stale", "-n", namespace, "kopf.zalando.org/touched=yes", check=True)
    kube.execute(job, [PatchStatus({"phase": "Pending"})])
    assert kubectl_json("get", "dtj", "stale", "-n", namespace)["status"]["phase"] == "Pending"
    job = kube.get_job(namespace, "stale", fresh=True) or {}
    scale = '{"spec":{"replicas":2}}'
    kubectl("patch", "dtj", "stale", "-n", namespace, "--type=merge", "-p", scale, check=True)
    with pytest.raises(JobChanged):
        kube.execute(job, [PatchStatus({"phase": "Running"})])
    assert kubectl_json("get", "dtj", "stale", "-n", namespace)["status"]["phase"] == "Pending"


def test_observe_reads_the_leases_of_silent_nodes_only(namespace: str) -> None:
    """Observed.leases: the node Leases of status.silentNodes, as the kubelet renews them (the
    nodelet every 4 s); a node without a Lease is left out, and no other node's is read."""
    kube = Kube(OperatorMetrics(), ObserverSettings())
    job = make_job(namespace, "leases")
    nodes = sorted(n["metadata"]["name"] for n in kube.observe(job).nodes)
    assert kube.observe(job).leases == {}, "nothing silent, nothing deleting: no Lease read"
    job["status"] = {
        "silentNodes": [
            {"name": nodes[0], "since": "2026-01-01T00:00:00Z"},
            {"name": "no-such-node", "since": "2026-01-01T00:00:00Z"},
        ]
    }
    first = kube.observe(job).leases
    assert list(first) == [nodes[0]] and first[nodes[0]].endswith("Z")
    wait_for(
        "the kubelet's next renewal",
        lambda: kube.observe(job).leases[nodes[0]] != first[nodes[0]],
        timeout=30,
    )


def test_a_worker_avoiding_silent_nodes_is_a_pod_the_api_server_accepts(namespace: str) -> None:
    """status.silentNodes become required node affinity; with two nodes silent at once the API
    server refused the first form (one NotIn of two values: a node field selector takes one)."""
    job = make_job(namespace, "avoids")
    term = {"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}
    required = {"nodeSelectorTerms": [term]}
    job["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
    }
    for avoid in (["node-1"], ["node-1", "node-2", "node-3"]):
        pod = yaml.safe_dump(worker_pod(JobView(job), 0, 1, 0, WorkerDefaults(), avoid_nodes=avoid))
        kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-", input=pod, check=True)


def test_a_refused_action_names_itself_and_the_server_reason(namespace: str) -> None:
    kube = Kube(OperatorMetrics(), ObserverSettings())
    job = make_job(namespace, "refused-action")
    pod = worker_pod(JobView(job), rank=0, world_size=1, generation=0, defaults=WorkerDefaults())
    pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}
    with pytest.raises(ActionFailed) as failed:
        kube.execute(
            job, [EmitEvent("Normal", "Before", "runs"), CreatePod(pod), EmitEvent("Normal", "After", "")]
        )
    assert "creating pod refused-action-worker-0" in str(failed.value) and "422" in str(failed.value)
    assert [e["reason"] for e in job_events(namespace, "refused-action")] == ["Before"], (
        "stops at the failure"
    )


# --- JobPassRunner ----------------------------------------------------------------------------------
def no_pods_quota(namespace: str) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pods"},
        "spec": {"hard": {"pods": "0"}},
    }
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(quota), check=True)


def test_a_failing_pass_is_reported_retried_with_backoff_and_recovers(namespace: str) -> None:
    metrics = OperatorMetrics()
    settings = OperatorSettings(retry=RetrySettings(backoff_seconds=1, backoff_max_seconds=2))
    runner = JobPassRunner(Kube(metrics, settings.observer), metrics, settings)
    no_pods_quota(namespace)
    make_job(namespace, "backoff")
    try:
        started = time.monotonic()
        runner.trigger(namespace, "backoff")  # the pass hands its writes over and returns
        # The pod creation fails after its pass; the next pass reports it and backs off.
        wait_for(
            "the failed creation",
            lambda: runner.failing_attempts(namespace, "backoff") > 0,
            timeout=30,
            interval=0.01,
        )
        reported = time.monotonic() - started
        assert runner.failing_attempts(namespace, "backoff") == 1
        triggered = 0
        while time.monotonic() - started < reported + 0.5:  # well inside the 1 s backoff
            runner.trigger(namespace, "backoff")  # waits for the scheduled retry: no pass
            triggered += 1
        assert triggered > 0 and runner.failing_attempts(namespace, "backoff") == 1
        wait_for("the report on the job", lambda: "Reconciled" in conditions(namespace, "backoff"))
        reconciled = conditions(namespace, "backoff")["Reconciled"]
        assert (reconciled["status"], reconciled["reason"]) == ("False", "ActionFailed")
        assert "creating pod backoff-worker-0: 403 Forbidden" in reconciled["message"]
        assert reconciled["message"].endswith("(attempt 1; retrying in 1s)")
        warnings = [e for e in job_events(namespace, "backoff") if e["type"] == "Warning"]
        assert [e["reason"] for e in warnings] == ["ActionFailed"]
        # The retries come by themselves: 1 s, then 2 s, then 2 s (the cap) apart.
        wait_for("a third attempt", lambda: runner.failing_attempts(namespace, "backoff") >= 3, timeout=20)
        assert time.monotonic() - started >= 3
        assert "(attempt 3; retrying in 2s)" in conditions(namespace, "backoff")["Reconciled"]["message"]
        assert len([e for e in job_events(namespace, "backoff") if e["type"] == "Warning"]) == 1
    finally:
        kubectl("delete", "resourcequota", "no-pods", "-n", namespace, check=True)
    wait_for(
        "the retry to create the pod", lambda: runner.failing_attempts(namespace, "backoff") == 0, timeout=30
    )
    wait_for("Recovered", lambda: conditions(namespace, "backoff")["Reconciled"]["status"] == "True")
    reconciled = conditions(namespace, "backoff")["Reconciled"]
    assert (reconciled["status"], reconciled["reason"]) == ("True", "Reconciled")
    assert kubectl("get", "pod", "backoff-worker-0", "-n", namespace).returncode == 0
    assert "Recovered" in [e["reason"] for e in job_events(namespace, "backoff")]
    errors = metrics.registry.get_sample_value("dtjob_operator_reconcile_errors_total", {"stage": "act"})
    assert errors is not None and errors >= 3
    print(f"failure reported on the job {reported:.2f}s after the trigger")


def test_a_job_deleted_between_passes_is_forgotten(namespace: str) -> None:
    metrics = OperatorMetrics()
    runner = JobPassRunner(Kube(metrics, ObserverSettings()), metrics, OperatorSettings())
    make_job(namespace, "gone")
    runner.trigger(namespace, "gone")
    kubectl("delete", "dtj", "gone", "-n", namespace, "--wait=true", check=True)
    runner.trigger(namespace, "gone")
    assert runner.failing_attempts(namespace, "gone") == 0
