"""Operator e2e on the devcluster: an integer GPU request runs; an error while acting on a job
shows on the job within seconds and clears by itself once its cause is gone (measured after the
first test, so the operator's start is not in the figure)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import Devcluster, kubectl, wait_for
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
    wait_phase,
    wait_status,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-errors")


def record(measurement: dict[str, object]) -> None:
    print(json.dumps(measurement))
    with (SCRATCH / "measurements.jsonl").open("a") as out:
        out.write(json.dumps(measurement) + "\n")


def warning(op: Operator, name: str, reason: str) -> dict[str, Any] | None:
    return next((e for e in events(op, name) if e["reason"] == reason and e["type"] == "Warning"), None)


def test_an_integer_gpu_request_gets_its_pods(op: Operator) -> None:
    manifest = job_manifest(op, "gpu", replicas=2, command=SLEEPER)
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer["resources"] = {"requests": {"cpu": "250m", "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    apply(manifest)
    stored = kubectl("get", "dtj", "gpu", "-n", op.namespace, "-o", "json", check=True).stdout
    limits = json.loads(stored)["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 1}, "the API server keeps the integer"
    wait_phase(op, "gpu", "Running", timeout=90)
    workers = pods(op, "gpu")
    assert len(workers) == 2
    for pod in workers:
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert condition(status(op, "gpu"), "Reconciled") == {}, "no pass of this job failed"


def test_a_refused_pod_shows_on_the_job_in_seconds_and_the_job_recovers_by_itself(op: Operator) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pods", "namespace": op.namespace},
        "spec": {"hard": {"pods": "0"}},
    }
    kubectl("apply", "-f", "-", input=yaml.safe_dump(quota), check=True)
    applied_at = time.monotonic()
    apply(job_manifest(op, "refused", replicas=2, command=SLEEPER))
    wait_for("the ActionFailed event", lambda: warning(op, "refused", "ActionFailed") is not None, timeout=60)
    seen_after = time.monotonic() - applied_at
    event = warning(op, "refused", "ActionFailed") or {}
    assert event["message"].startswith("creating pod refused-worker-0: 403 Forbidden: ")
    assert "exceeded quota" in event["message"], event["message"]
    st = wait_status(
        op,
        "refused",
        "condition Reconciled=False",
        lambda s: condition(s, "Reconciled").get("status") == "False",
        timeout=30,
    )
    reconciled = condition(st, "Reconciled")
    assert reconciled["reason"] == "ActionFailed" and "(attempt " in reconciled["message"]
    assert "; retrying in " in reconciled["message"]
    assert pods(op, "refused") == []
    time.sleep(4)  # retried with backoff (1, 2, 4 s ...), the same error posts no new event
    failures = [e for e in events(op, "refused") if e["reason"] == "ActionFailed"]
    assert len(failures) == 1 and failures[0].get("count", 1) == 1, failures
    attempts = int(
        condition(status(op, "refused"), "Reconciled")["message"].split("(attempt ")[1].split(";")[0]
    )
    assert attempts >= 2, "retried by itself"

    kubectl("delete", "resourcequota", "no-pods", "-n", op.namespace, check=True)
    lifted_at = time.monotonic()
    running = wait_phase(op, "refused", "Running", timeout=90)
    recovered_after = time.monotonic() - lifted_at
    reconciled = condition(running, "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("True", "Reconciled")
    assert reconciled["message"].startswith("recovered after ") and "exceeded quota" in reconciled["message"]
    assert any(e["reason"] == "Recovered" and e["type"] == "Normal" for e in events(op, "refused"))
    assert 'dtjob_operator_reconcile_errors_total{stage="act"}' in op.metrics()
    record(
        {
            "measure": "operator_error_to_job_event_seconds",
            "value": round(seen_after, 1),
            "recovered_after_cause_removed_seconds": round(recovered_after, 1),
            "attempts_before_the_cause_was_removed": attempts,
        }
    )
