"""Operator e2e on the devcluster: a job whose trainer is a plain script without dtjob metrics
(tests/e2e/plain_trainer.py) still rescales as planned, and its status says what the operator
cannot see and what it waits for."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Devcluster, kubectl
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    condition,
    events,
    job_manifest,
    operator_namespace,
    pods,
    wait_phase,
    wait_status,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PLAIN_TRAINER = Path(__file__).with_name("plain_trainer.py")
# The operator concludes "no metrics" after this much running (the default is 30 s).
METRICS_GRACE_SECONDS = 5


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-plain", ["--metrics-grace-seconds", str(METRICS_GRACE_SECONDS)])


def running_at(size: int, generation: int) -> Any:
    return lambda s: (s.get("replicas"), s.get("generation"), s.get("phase")) == (size, generation, "Running")


def test_a_trainer_without_dtjob_metrics_still_scales_up_and_down(op: Operator) -> None:
    command = [sys.executable, str(PLAIN_TRAINER), "/steplog/done"]
    # spec.checkpoint is set: before, a scale-up waited forever for a checkpoint it would never see
    apply(job_manifest(op, "plain", replicas=2, min_replicas=1, max_replicas=3, command=command))
    wait_phase(op, "plain", "Running")
    waits: list[str] = []

    def grown(s: dict[str, Any]) -> bool:
        reason = condition(s, "Waiting").get("reason")
        if condition(s, "Waiting").get("status") == "True" and reason not in waits:
            waits.append(str(reason))
        return bool(running_at(3, 1)(s))

    kubectl("scale", "dtj/plain", "-n", op.namespace, "--replicas=3", check=True)
    up = wait_status(op, "plain", "grown to 3 running workers", grown, timeout=120)
    print(f"waits seen while growing: {waits}")
    available = condition(up, "MetricsAvailable")
    assert (available["status"], available["reason"]) == ("False", "NoMetrics"), available
    assert f"in {METRICS_GRACE_SECONDS}s of running" in available["message"]
    assert up["restarts"] == 0, "a planned rescale: the script exited 75 on SIGTERM"

    kubectl("scale", "dtj/plain", "-n", op.namespace, "--replicas=2", check=True)
    wait_status(op, "plain", "shrunk to 2 running workers", running_at(2, 2), timeout=120)
    (SCRATCH / op.namespace / "plain" / "logs" / "done").touch()
    done = wait_phase(op, "plain", "Succeeded", timeout=120)
    assert (done["generation"], done["restarts"], done["replicas"]) == (2, 0, 2)
    assert "step" not in done, "the operator reports no step it could not see"
    assert condition(done, "Waiting").get("status") != "True"
    finished = pods(op, "plain")
    assert sorted(p["metadata"]["name"] for p in finished) == ["plain-worker-0", "plain-worker-1"]
    assert all(p["status"]["phase"] == "Succeeded" for p in finished)
    reasons = [e["reason"] for e in events(op, "plain")]
    assert reasons.count("ScaleUp") == 1 and reasons.count("ScaleDown") == 1
