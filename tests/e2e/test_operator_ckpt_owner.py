"""Operator e2e on the devcluster: a job given another live job's checkpoint directory is held
with no pods, names the other job, and starts on its own (resuming from that directory) once the
other job has finished (reconciler rule 2, dtjob.operator.ownership)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Devcluster
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    condition,
    events,
    job_manifest,
    open_gate,
    operator_namespace,
    pods,
    status,
    step_log,
    wait_phase,
    wait_status,
    wait_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-ckpt-owner")


def test_a_job_on_another_live_jobs_checkpoint_directory_waits_for_it_then_resumes_from_it(
    op: Operator,
) -> None:
    apply(job_manifest(op, "first", replicas=2, steps=10, gate=3))
    wait_phase(op, "first", "Running")
    wait_step(op, "first", 3)  # first's gang trains and writes the directory

    shared = {"volume": {"hostPath": {"path": str(SCRATCH / op.namespace / "first" / "checkpoints")}}}
    apply(job_manifest(op, "second", replicas=2, steps=20, checkpoint={**shared, "mountPath": "/ckpt"}))
    held = wait_status(
        op,
        "second",
        "held on the directory",
        lambda s: condition(s, "Waiting").get("reason") == "CheckpointDirInUse",
    )
    message = condition(held, "Waiting")["message"]
    assert "first" in message and "spec.checkpoint.volume" in message, message
    assert "phase" not in held, "not started"
    warned = [e for e in events(op, "second") if e["reason"] == "CheckpointDirInUse"]
    assert warned and warned[0]["type"] == "Warning" and "first" in warned[0]["message"]
    time.sleep(3)  # a few of the operator's passes (its timer ticks every 1-5 s)
    assert pods(op, "second") == [], "held: no pods while first runs"
    assert status(op, "first")["phase"] == "Running"

    open_gate(op, "first", 10)
    wait_phase(op, "first", "Succeeded")
    done = wait_phase(op, "second", "Succeeded", timeout=180)
    assert done["step"] == 20 and done["restarts"] == 0
    steps = [r["step"] for r in step_log(op, "second")]
    assert steps == list(range(11, 21)), "second resumed from first's final checkpoint, alone on it"
