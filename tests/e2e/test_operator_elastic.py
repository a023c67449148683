"""Operator e2e on the devcluster: planned rescales (kubectl scale, suspend/resume) and node loss
with shrink and grow-back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import Devcluster, kubectl, wait_for
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    devcluster_node,
    events,
    job_manifest,
    open_gate,
    operator_namespace,
    pods,
    step_log,
    wait_phase,
    wait_status,
    wait_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-elastic")


def generations(log: list[dict[str, Any]]) -> list[tuple[int, int, int, int]]:
    """(generation, world size, first step, last step) of each generation, in order."""
    out: list[tuple[int, int, int, int]] = []
    for r in log:
        if out and out[-1][0] == r["generation"]:
            g, w, first, _ = out[-1]
            out[-1] = (g, w, first, r["step"])
        else:
            out.append((r["generation"], r["world_size"], r["step"], r["step"]))
    return out


def record(measurement: dict[str, object]) -> None:
    print(json.dumps(measurement))
    with (SCRATCH / "measurements.jsonl").open("a") as out:
        out.write(json.dumps(measurement) + "\n")


def test_kubectl_scale_down_and_up_loses_and_repeats_no_step(op: Operator) -> None:
    # The step gate holds each generation at the step the test acts on; a stop asked for at the
    # gate runs one more step and checkpoints it.
    steps = 40
    apply(job_manifest(op, "scale", replicas=3, min_replicas=1, max_replicas=3, steps=steps, gate=10))
    wait_step(op, "scale", 10)
    kubectl("scale", "dtj/scale", "-n", op.namespace, "--replicas=2", check=True)
    wait_status(
        op, "scale", "2 workers running", lambda s: s.get("replicas") == 2 and s.get("phase") == "Running"
    )
    open_gate(op, "scale", 18)  # past a checkpoint (every 5): a grow-back waits for one
    wait_step(op, "scale", 18)
    kubectl("scale", "dtj/scale", "-n", op.namespace, "--replicas=3", check=True)
    wait_status(op, "scale", "3 workers running again", running_at(3, generation=2))
    open_gate(op, "scale", steps)
    done = wait_phase(op, "scale", "Succeeded")
    assert done["restarts"] == 0 and done["generation"] == 2 and done["step"] == steps
    log = step_log(op, "scale")
    assert [r["step"] for r in log] == list(range(1, steps + 1)), "every step exactly once"
    assert [(g, w) for g, w, _, _ in generations(log)] == [(0, 3), (1, 2), (2, 3)]
    reasons = [e["reason"] for e in events(op, "scale")]
    assert "ScaleDown" in reasons and "ScaleUp" in reasons
    metrics = op.metrics()
    assert 'dtjob_operator_rescales_total{direction="down",reason="ScaleDown"} 1.0' in metrics
    assert 'dtjob_operator_rescales_total{direction="up",reason="ScaleUp"} 1.0' in metrics
    record({"measure": "steps_lost_planned_rescale", "value": 0, "generations": generations(log)})


def test_suspend_then_resume_continues_from_the_step_reached(op: Operator) -> None:
    steps = 30
    apply(job_manifest(op, "pause", replicas=2, steps=steps, gate=10))
    wait_step(op, "pause", 10)
    patch = '{"spec": {"runPolicy": {"suspend": true}}}'
    kubectl("patch", "dtj", "pause", "-n", op.namespace, "--type=merge", "-p", patch, check=True)
    wait_phase(op, "pause", "Suspended")
    wait_for("the workers to stop", lambda: not pods(op, "pause"), timeout=90)
    reached = max(r["step"] for r in step_log(op, "pause"))
    checkpoint = SCRATCH / op.namespace / "pause" / "checkpoints" / f"step-{reached:08d}"
    assert checkpoint.exists(), f"suspending wrote a checkpoint at step {reached}"
    patch = '{"spec": {"runPolicy": {"suspend": false}}}'
    open_gate(op, "pause", steps)
    kubectl("patch", "dtj", "pause", "-n", op.namespace, "--type=merge", "-p", patch, check=True)
    done = wait_phase(op, "pause", "Succeeded")
    assert done["restarts"] == 0 and done["generation"] == 1 and done["step"] == steps
    log = step_log(op, "pause")
    assert [r["step"] for r in log] == list(range(1, steps + 1)), "resumed at the next step, none repeated"
    assert [g[2] for g in generations(log)] == [1, reached + 1]


def running_at(size: int, generation: int = 1) -> Any:
    return lambda s: (
        s.get("replicas") == size and s.get("phase") == "Running" and s.get("generation", 0) >= generation
    )


def _node_of(op: Operator, pod: str) -> str:
    for p in pods(op, "nodes"):
        if p["metadata"]["name"] == pod:
            return str(p["spec"]["nodeName"])
    pytest.fail(f"{pod} not found")


def test_node_loss_shrinks_not_below_min_and_grows_back_without_losing_a_step(op: Operator) -> None:
    # 3 cpus per worker on 4-cpu nodes: one worker per node, no spare capacity anywhere. The step
    # gate holds each generation where the test acts.
    steps = 40
    manifest = job_manifest(
        op,
        "nodes",
        replicas=3,
        min_replicas=2,
        max_replicas=3,
        steps=steps,
        cpu="3",
        checkpoint_every=4,
        gate=8,
    )
    apply(manifest)
    wait_step(op, "nodes", 8)
    lost = _node_of(op, "nodes-worker-1")
    devcluster_node("stop", lost)
    try:
        wait_status(op, "nodes", "shrunk to 2 running workers", running_at(2), timeout=120)
        open_gate(op, "nodes", 14)  # past the checkpoint of step 12: a grow-back waits for one
        wait_step(op, "nodes", 14, timeout=90)
    finally:
        devcluster_node("start", lost)
    grown = wait_status(
        op, "nodes", "grown back to 3 running workers", running_at(3, generation=2), timeout=120
    )
    open_gate(op, "nodes", steps)
    done = wait_phase(op, "nodes", "Succeeded", timeout=150)
    assert done["step"] == steps and done["generation"] == grown["generation"]
    gens = generations(step_log(op, "nodes"))
    sizes = [w for _, w, _, _ in gens]
    assert min(sizes) == 2 and sizes[-1] == 3, gens
    # the grow-back is planned: the 3-worker generation starts right after the 2-worker one's last step
    (_, _, _, last_small), (_, _, first_big, _) = gens[-2], gens[-1]
    assert first_big == last_small + 1, gens
    reasons = {e["reason"] for e in events(op, "nodes")}
    # The survivors' heartbeats usually see the silent node first (PeerLost, exit 76), else the
    # node's NotReady or the pod's failure does.
    assert "ScaleUp" in reasons and reasons & {"NodeLost", "WorkerFailed", "PeerLost"}, reasons
