"""Operator e2e on the devcluster: unplanned failures (a SIGKILLed worker, a killed operator, a
checkpoint the volume refuses, etcd and the API server restarting)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.chaos.faults import restart_component
from tests.e2e.conftest import Devcluster, wait_for
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
    ready_standbys,
    sigkill_worker,
    status,
    step_log,
    wait_phase,
    wait_status,
    wait_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-recover")


def record(measurement: dict[str, object]) -> None:
    """Measurements for the issue's report (also printed with -s)."""
    print(json.dumps(measurement))
    with (SCRATCH / "measurements.jsonl").open("a") as out:
        out.write(json.dumps(measurement) + "\n")


def test_sigkilled_worker_resumes_from_the_last_checkpoint_at_the_same_size(op: Operator) -> None:
    steps = 30
    manifest = job_manifest(
        op, "kill", replicas=3, steps=steps, checkpoint_every=5, gate=12, restart_in_place=False
    )
    apply(manifest)
    wait_step(op, "kill", 12)
    killed_at = sigkill_worker(op, "kill", rank=1)
    open_gate(op, "kill", steps)

    deadline = time.monotonic() + 150
    first_new_step_at = None
    while time.monotonic() < deadline and first_new_step_at is None:
        if any(r.get("generation", 0) >= 1 for r in step_log(op, "kill")):
            first_new_step_at = time.time()
        time.sleep(0.2)
    assert first_new_step_at is not None, "the next generation never logged a step"

    done = wait_phase(op, "kill", "Succeeded")
    assert (done["generation"], done["restarts"], done["replicas"], done["step"]) == (1, 1, 3, steps)
    log = step_log(op, "kill")
    before = [r["step"] for r in log if r["generation"] == 0]
    after = [r["step"] for r in log if r["generation"] == 1]
    resumed_from = after[0] - 1
    assert resumed_from % 5 == 0 and resumed_from <= before[-1], "resumed from a checkpoint step"
    assert after == list(range(after[0], steps + 1)), "the new generation runs every remaining step once"
    assert {r["world_size"] for r in log} == {3}
    assert any(e["reason"] == "WorkerFailed" for e in events(op, "kill"))
    metrics = op.metrics()
    assert 'dtjob_operator_gang_restarts_total{reason="WorkerFailed"} 1.0' in metrics
    assert "dtjob_operator_time_to_recover_seconds_count 1.0" in metrics
    assert 'dtjob_operator_jobs{phase="Succeeded"} 1.0' in metrics
    record(
        {
            "measure": "sigkill_to_next_generation_first_step_seconds",
            "value": round(first_new_step_at - killed_at, 1),
            "steps_lost_unplanned": before[-1] - resumed_from,
        }
    )


def test_a_sigkilled_trainer_restarts_in_place_in_the_same_pods(op: Operator) -> None:
    steps = 20
    apply(job_manifest(op, "inplace", replicas=2, steps=steps, checkpoint_every=5, gate=7, max_restarts=3))
    wait_step(op, "inplace", 7)
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(op, "inplace")}
    wait_for("both pods' standbys ready", lambda: ready_standbys(op, "inplace") == 2, timeout=300)
    killed_at = sigkill_worker(op, "inplace", rank=1)
    # The new round resumes at step 7 from memory and waits at the gate: its rank 0's metrics say
    # it restarted; then one more step is let through.
    st = wait_status(op, "inplace", "the restart in place counted", lambda s: s.get("restarts") == 1)
    open_gate(op, "inplace", 8)
    again = lambda: any(r.get("in_place_restarts") == 1 for r in step_log(op, "inplace"))  # noqa: E731
    wait_for("a step of the gang restarted in place", again, timeout=120)
    again_at = time.time()
    assert (st["generation"], st["inPlaceRestarts"]) == (0, 1)
    event = next(e for e in events(op, "inplace") if e["reason"] == "RestartedInPlace")
    assert event["type"] == "Warning" and "rank 1 (pod 1) exited 137 (SIGKILL)" in event["message"]
    open_gate(op, "inplace", steps)
    done = wait_phase(op, "inplace", "Succeeded")
    assert (done["generation"], done["restarts"], done["step"]) == (0, 1, steps)
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(op, "inplace")} == uids, "the same pods"
    log = step_log(op, "inplace")
    before = [r["step"] for r in log if r["in_place_restarts"] == 0]
    after = [r["step"] for r in log if r["in_place_restarts"] == 1]
    # The gang resumed from the in-memory snapshot of step 7 (#42), not the checkpoint of step 5:
    # no step redone.
    assert before == list(range(1, 8)) and after == list(range(8, steps + 1)), (before, after)
    assert next(r for r in log if r["in_place_restarts"] == 1).get("resumed_from") == "memory"
    assert 'dtjob_operator_gang_restarts_total{reason="InPlace"} 1.0' in op.metrics()
    # (includes the wait for the operator to count the restart before the gate opens)
    record({"measure": "sigkill_to_first_step_in_place_seconds", "value": round(again_at - killed_at, 1)})


def test_operator_killed_during_a_gang_restart_converges_without_duplicates(op: Operator) -> None:
    steps = 30
    # A restart in new pods (in place, no pod would be replaced while the operator is down).
    manifest = job_manifest(
        op, "crash", replicas=3, steps=steps, checkpoint_every=5, gate=8, restart_in_place=False
    )
    apply(manifest)
    wait_step(op, "crash", 8)
    sigkill_worker(op, "crash", rank=2)
    wait_status(op, "crash", "a gang restart under way", lambda s: s.get("generation", 0) >= 1)
    op.kill()
    generations_seen: list[set[str]] = []
    for _ in range(6):  # the operator is down: nothing may create a second gang
        generations_seen.append(
            {p["metadata"]["labels"]["training.dtjob.io/generation"] for p in pods(op, "crash")}
        )
        time.sleep(0.5)
    op.start()
    open_gate(op, "crash", steps)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and status(op, "crash").get("phase") != "Succeeded":
        current = pods(op, "crash")
        generations_seen.append({p["metadata"]["labels"]["training.dtjob.io/generation"] for p in current})
        assert len(current) <= 3, f"more pods than workers: {[p['metadata']['name'] for p in current]}"
        time.sleep(1.0)
    done = wait_phase(op, "crash", "Succeeded", timeout=10)
    assert (done["generation"], done["restarts"], done["step"]) == (1, 1, steps)
    assert all(len(g) <= 1 for g in generations_seen), f"two generations' pods at once: {generations_seen}"
    final = pods(op, "crash")
    assert sorted(p["metadata"]["name"] for p in final) == [f"crash-worker-{r}" for r in range(3)]
    for pod in final:
        assert pod["metadata"]["labels"]["training.dtjob.io/generation"] == "1"
        assert pod["metadata"]["ownerReferences"][0]["name"] == "crash"
    assert condition(done, "Succeeded")["status"] == "True"


def test_a_checkpoint_the_volume_refuses_shows_on_the_job_and_costs_no_restart(op: Operator) -> None:
    steps = 12
    apply(job_manifest(op, "full", replicas=2, steps=steps, checkpoint_every=3, gate=4))
    wait_step(op, "full", 4)
    # Rank 1's file of step 6 goes to the kernel's full device: ENOSPC, as on a full volume.
    staging = SCRATCH / op.namespace / "full" / "checkpoints" / ".staging-step-00000006-g0"
    staging.mkdir()
    (staging / "rank-00001.pt.tmp").symlink_to("/dev/full")
    open_gate(op, "full", 7)
    failing = lambda s: condition(s, "CheckpointWriteFailing").get("status") == "True"  # noqa: E731
    st = wait_status(op, "full", "condition CheckpointWriteFailing", failing)
    assert "1 checkpoint writes in a row refused" in condition(st, "CheckpointWriteFailing")["message"]
    assert "resume from step 3" in condition(st, "CheckpointWriteFailing")["message"]
    assert "CheckpointWriteFailed" in [e["reason"] for e in events(op, "full")]
    assert not staging.exists(), "rank 0 removed the failed attempt"

    open_gate(op, "full", steps)
    done = wait_phase(op, "full", "Succeeded")
    assert (done["generation"], done["restarts"], done["step"]) == (0, 0, steps), done
    assert condition(done, "CheckpointWriteFailing")["status"] == "False", "step 9's checkpoint was written"
    assert [r["step"] for r in step_log(op, "full")] == list(range(1, steps + 1))


def test_etcd_and_the_api_server_restarting_mid_job_cost_no_restart(op: Operator) -> None:
    """A control plane that goes away is not a failure of the job: the gang trains on without it
    (held at its gate while etcd is down, training while the API server is), and the operator,
    its watches broken and listed again, neither restarts the gang nor makes a second one."""
    steps = 20
    apply(job_manifest(op, "cp", replicas=2, steps=steps, checkpoint_every=5, gate=6))
    wait_step(op, "cp", 6)
    restart_component("etcd", down_seconds=3)
    open_gate(op, "cp", 12)
    restart_component("kube-apiserver", down_seconds=3)
    wait_step(op, "cp", 12)
    open_gate(op, "cp", steps)
    done = wait_phase(op, "cp", "Succeeded")
    assert (done["generation"], done["restarts"], done["step"]) == (0, 0, steps), events(op, "cp")
    assert [r["step"] for r in step_log(op, "cp")] == list(range(1, steps + 1))
    assert sorted(p["metadata"]["name"] for p in pods(op, "cp")) == ["cp-worker-0", "cp-worker-1"]
