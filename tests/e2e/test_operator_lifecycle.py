"""Operator e2e on the devcluster: a job to Succeeded, failing jobs, Volcano PodGroups."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Devcluster, apply_crd, kubectl, kubectl_json, volcano_podgroup_crd, wait_for
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    condition,
    events,
    job_manifest,
    operator_namespace,
    pods,
    status,
    step_log,
    wait_phase,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-life")


def test_job_runs_to_succeeded_with_status_events_columns_and_clean_deletion(op: Operator) -> None:
    apply(job_manifest(op, "tiny", replicas=2, steps=30))
    running = wait_phase(op, "tiny", "Running")
    assert running["replicas"] == 2 and running["generation"] == 0
    assert running["selector"] == "training.dtjob.io/job-name=tiny"
    workers = pods(op, "tiny")
    assert sorted(p["metadata"]["name"] for p in workers) == ["tiny-worker-0", "tiny-worker-1"]
    env = {e["name"]: e.get("value") for e in workers[0]["spec"]["containers"][0]["env"]}
    assert env["MASTER_ADDR"] == f"tiny-worker-0.tiny.{op.namespace}.svc" and env["WORLD_SIZE"] == "2"

    done = wait_phase(op, "tiny", "Succeeded")
    assert done["step"] == 30 and done["restarts"] == 0 and done["generation"] == 0
    assert done["lastCheckpoint"]["step"] == 30, "the final checkpoint, from the closing log line"
    assert done["startTime"] <= done["completionTime"]
    steps = step_log(op, "tiny")
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert steps[-1]["loss"] < steps[0]["loss"], "the loss falls"

    reasons = [e["reason"] for e in events(op, "tiny")]
    assert {"Created", "Running", "Succeeded"} <= set(reasons)
    table = kubectl("get", "dtj", "tiny", "-n", op.namespace, check=True).stdout.splitlines()
    header, row = table[0].split(), table[1].split()
    assert header[:2] == ["NAME", "PHASE"] and row[:2] == ["tiny", "Succeeded"]
    assert "30" in row, f"the step column shows 30: {table}"

    kubectl("delete", "dtj", "tiny", "-n", op.namespace, "--wait=true", "--timeout=60s", check=True)

    def children_gone() -> bool:
        service = kubectl("get", "service", "tiny", "-n", op.namespace)
        return not pods(op, "tiny") and service.returncode != 0

    wait_for("the job's pods and Service to be garbage-collected", children_gone, timeout=60)


def test_workers_that_keep_failing_fail_the_job_after_max_restarts(op: Operator) -> None:
    crash = [sys.executable, "-c", "import sys; sys.exit(1)"]
    apply(job_manifest(op, "crashy", replicas=2, max_restarts=2, command=crash))
    failed = wait_phase(op, "crashy", "Failed", timeout=120)
    assert failed["restarts"] == 3 and failed["generation"] == 2
    why = condition(failed, "Failed")
    assert why["reason"] == "MaxRestartsExceeded"
    assert "maxRestarts=2" in why["message"] and "exit code 1" in why["message"]


def test_a_permanent_exit_code_fails_the_job_at_once(op: Operator) -> None:
    bad_flag = [sys.executable, "-c", "import sys; sys.exit(127)"]
    apply(job_manifest(op, "typo", replicas=2, max_restarts=5, command=bad_flag))
    failed = wait_phase(op, "typo", "Failed", timeout=90)
    assert failed["restarts"] == 0 and failed["generation"] == 0
    assert condition(failed, "Failed")["reason"] == "PermanentError"
    assert "127" in condition(failed, "Failed")["message"]


def test_volcano_job_gets_a_podgroup_of_the_gang_shape(op: Operator) -> None:
    crd = volcano_podgroup_crd()
    apply_crd(crd)
    priority = "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\nmetadata: {name: dtjob-e2e-high}\n"
    priority += "value: 1000\n"
    kubectl("apply", "-f", "-", input=priority, check=True)
    scheduling = {"schedulerName": "volcano", "queue": "research", "priorityClassName": "dtjob-e2e-high"}
    apply(job_manifest(op, "gang", replicas=3, cpu="500m", scheduling=scheduling))

    def group() -> dict[str, object] | None:
        got = kubectl("get", "podgroups.scheduling.volcano.sh", "gang", "-n", op.namespace, "-o", "json")
        return (
            None
            if got.returncode
            else kubectl_json("get", "podgroups.scheduling.volcano.sh", "gang", "-n", op.namespace)
        )

    wait_for("the PodGroup", lambda: group() is not None, timeout=60)
    wait_for("3 pods", lambda: len(pods(op, "gang")) == 3, timeout=60)
    podgroup = kubectl_json("get", "podgroups.scheduling.volcano.sh", "gang", "-n", op.namespace)
    assert podgroup["spec"]["minMember"] == 3
    assert podgroup["spec"]["queue"] == "research"
    assert podgroup["spec"]["priorityClassName"] == "dtjob-e2e-high"
    assert podgroup["spec"]["minResources"]["cpu"] in {"1500m", "1.5"}
    owner = podgroup["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "DistributedTrainingJob" and owner["name"] == "gang" and owner["controller"]
    for pod in pods(op, "gang"):
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gang"
        assert pod["spec"].get("priorityClassName") == "dtjob-e2e-high"
    # no Volcano scheduler runs here (or, after `up --volcano`, no queue `research`): the gang waits
    assert status(op, "gang")["phase"] == "Pending"
    kubectl("delete", "dtj", "gang", "-n", op.namespace, "--wait=true", "--timeout=60s", check=True)


def peering_active(op: Operator) -> bool:
    """Whether kopf's last peering decision in the operator's log was to run (not to pause)."""
    decisions = [
        line for line in op.log.read_text().splitlines() if "operations" in line and "peering" in line
    ]
    return bool(decisions) and "Resuming operations" in decisions[-1]


def test_of_two_peered_operators_only_the_higher_priority_one_acts(op: Operator) -> None:
    namespace = f"{op.namespace}-peers"
    kubectl("create", "namespace", namespace, check=True)
    low = Operator(namespace, SCRATCH / f"{namespace}-low.log", peering=["--peering=e2e", "--priority=1"])
    high = Operator(namespace, SCRATCH / f"{namespace}-high.log", peering=["--peering=e2e", "--priority=2"])
    try:
        # kopf starts paused and resumes once the peering shows no peer of higher priority
        high.start()
        wait_for("the high-priority operator to become active", lambda: peering_active(high), timeout=60)
        low.start()
        wait_for("the low-priority operator to start", lambda: "serving" in low.log.read_text(), timeout=60)
        deadline = time.monotonic() + 5  # a few peering heartbeats: the decision must hold throughout
        while time.monotonic() < deadline:
            assert peering_active(high) and not peering_active(low), "not exactly one operator active"
            time.sleep(0.5)
        crash = [sys.executable, "-c", "import sys; sys.exit(127)"]
        apply(job_manifest(Operator(namespace, low.log), "peered", replicas=2, command=crash))
        wait_phase(high, "peered", "Failed", timeout=90)
        assert "creating peered-worker-0" in high.log.read_text()
        assert "peered-worker" not in low.log.read_text(), "the paused operator acted"
        high.stop()  # a clean stop removes it from the peering: the other one takes over
        wait_for(
            "the low-priority operator to take over",
            lambda: peering_active(low),
            timeout=60,
        )
        apply(job_manifest(Operator(namespace, low.log), "after", replicas=1, command=crash))
        wait_phase(low, "after", "Failed", timeout=90)
        assert "creating after-worker-0" in low.log.read_text()
    finally:
        low_alive = low.proc is not None and low.proc.poll() is None
        if not low_alive:
            low.start()
        kubectl("delete", "dtj", "--all", "-n", namespace, "--wait=true", "--timeout=60s")
        low.stop()
        high.stop()
        kubectl("delete", "namespace", namespace, "--wait=false")
