"""The reconciler's elastic rules: shrink when unschedulable, grow back, kubectl scale."""

from __future__ import annotations

from typing import Any

from dtjob.operator.actions import CountRescale, CountRestart, ObserveRecovery, PatchStatus
from dtjob.operator.timefmt import to_rfc3339
from tests.unit.reconciler_fixtures import (
    applied,
    at,
    creates,
    deletes,
    env_of,
    events,
    gang,
    make_job,
    make_node,
    make_pod,
    run,
    running_status,
    status_patch,
    two_nodes,
    waiting,
)


def pending_gang() -> list[dict[str, Any]]:
    """Two workers scheduled on n1, two unschedulable since t=0."""
    return [
        make_pod(0),
        make_pod(1),
        make_pod(2, phase="Pending", node=None),
        make_pod(3, phase="Pending", node=None),
    ]


def test_unschedulable_gang_waits_for_the_timeout_then_shrinks_planned() -> None:
    job = make_job(status={**running_status(), "phase": "Pending", "conditions": [], "readyReplicas": 2})
    nodes = [make_node("n1")]
    before = run(job, pending_gang(), nodes, now=29)
    assert waiting(before) == (
        "Workers",
        "waiting for 2 of 4 workers of generation 0 to run (2 not scheduled yet)",
    )
    assert [type(a) for a in before] == [PatchStatus], "nothing but the status says what it waits for"
    actions = run(job, pending_gang(), nodes, now=31)
    patch = status_patch(actions)
    assert patch["generation"] == 1 and patch["replicas"] == 2
    assert "restarts" not in patch, "shrinking is planned, not a failure"
    assert next(c for c in patch["conditions"] if c["type"] == "Restarting")["reason"] == "Unschedulable"
    assert CountRescale("down", "Unschedulable") in actions
    assert not any(isinstance(a, CountRestart) for a in actions)
    assert "Rescale" in [e.reason for e in events(actions)]
    assert {d.grace_seconds for d in deletes(actions)} == {5}, "never trained: nothing to checkpoint"
    assert len(deletes(actions)) == 4


def test_unschedulable_at_min_replicas_waits_saying_so() -> None:
    job = make_job(min_replicas=4, status={**running_status(), "phase": "Pending", "conditions": []})
    actions = run(job, pending_gang(), [make_node("n1")], now=31)
    patch = status_patch(actions)
    assert "generation" not in patch and deletes(actions) == []
    schedulable = next(c for c in patch["conditions"] if c["type"] == "Schedulable")
    assert schedulable["status"] == "False" and "minReplicas=4" in schedulable["message"]


def checkpointed(status: dict[str, Any], at_seconds: float) -> dict[str, Any]:
    return {**status, "lastCheckpoint": {"step": 10, "time": to_rfc3339(at(at_seconds))}}


def test_shrunk_gang_grows_back_when_capacity_returns() -> None:
    job = make_job(status=checkpointed(running_status(size=2, generation=1, since=0), 50))
    actions = run(job, gang(2, generation=1), two_nodes(), now=100)
    patch = status_patch(actions)
    assert patch["replicas"] == 4 and patch["generation"] == 2 and "restarts" not in patch
    assert CountRescale("up", "ScaleUp") in actions
    assert all(d.grace_seconds is None for d in deletes(actions)), "SIGTERM: checkpoint, exit 75"
    # the grown gang starts when the old one is gone
    grown = creates(run(applied(job, actions), [], two_nodes(), now=101))
    assert len(grown) == 4 and env_of(grown[0].manifest)["WORLD_SIZE"] == "4"


def no_growth(job: dict[str, Any], nodes: list[dict[str, Any]]) -> tuple[str, str] | None:
    """What a 2-worker gang of generation 1 that wants 4 waits for, asserting it does nothing else."""
    actions = run(job, gang(2, generation=1), nodes, now=100)
    assert [type(a) for a in actions] == [PatchStatus] and "generation" not in status_patch(actions)
    return waiting(actions)


def test_no_growth_without_capacity_or_right_after_a_rescale_or_before_a_checkpoint() -> None:
    job = make_job(status=checkpointed(running_status(size=2, generation=1, since=97), 98))
    assert no_growth(job, two_nodes()) == (
        "RescaleHold",
        "generation 1 runs at 2 workers; it grows to 4 once it has run 5s",
    )
    job = make_job(status=checkpointed(running_status(size=2, generation=1, since=0), 50))
    assert no_growth(job, [make_node("n1")]) == (
        "Capacity",
        "waiting for capacity to grow from 2 to 4 workers: 2 fit",
    )  # n2 still missing
    job = make_job(status=checkpointed(running_status(size=2, generation=1, since=60), 50))
    reason, message = no_growth(job, two_nodes()) or ("", "")
    assert reason == "Checkpoint" and message.startswith(
        "waiting for generation 1's first checkpoint before growing from 2 to 4 workers"
    )
    # each wait is written once: the same observation again asks for nothing
    assert (
        run(
            applied(job, run(job, gang(2, generation=1), two_nodes(), now=100)),
            gang(2, generation=1),
            two_nodes(),
            now=100,
        )
        == []
    )


def test_kubectl_scale_down_is_a_planned_rescale() -> None:
    job = make_job(replicas=2, status=running_status())
    actions = run(job, gang(4), two_nodes())
    patch = status_patch(actions)
    assert patch["replicas"] == 2 and patch["generation"] == 1 and "restarts" not in patch
    assert next(c for c in patch["conditions"] if c["type"] == "Restarting")["reason"] == "ScaleDown"
    assert CountRescale("down", "ScaleDown") in actions
    assert all(d.grace_seconds is None for d in deletes(actions))


def test_kubectl_scale_up_grows_within_max_replicas() -> None:
    job = make_job(replicas=3, max_replicas=3, status=checkpointed(running_status(size=2), 20))
    patch = status_patch(run(job, gang(2), two_nodes()))
    assert patch["replicas"] == 3


def test_planned_rescale_is_no_recovery() -> None:
    status = {**running_status(size=2, generation=1), "phase": "Restarting"}
    status["conditions"] = [
        {
            "type": "Restarting",
            "status": "True",
            "reason": "ScaleDown",
            "message": "",
            "lastTransitionTime": "2026-01-01T12:00:00Z",
        }
    ]
    actions = run(make_job(replicas=2, status=status), gang(2, generation=1), two_nodes())
    assert status_patch(actions)["phase"] == "Running"
    assert not any(isinstance(a, ObserveRecovery) for a in actions)


def test_extra_ranks_beyond_the_world_size_are_removed() -> None:
    job = make_job(replicas=2, status={**running_status(size=2, generation=1), "phase": "Restarting"})
    pods = [*gang(2, generation=1), make_pod(2, generation=1)]
    actions = run(job, pods, two_nodes())
    assert [d.name for d in deletes(actions)] == ["gpt-worker-2"]
    assert creates(actions) == []
