"""The reconciler with Volcano: the PodGroup follows each generation, the scheduler's view of the
gang shows on the job, a preemption is a planned stop, and a waiting gang is not shrunk for
capacity it has."""

from __future__ import annotations

from typing import Any

from dtjob.operator import gang as volcano
from dtjob.operator.actions import ApplyPodGroup, CountRestart
from dtjob.operator.timefmt import to_rfc3339
from tests.unit.reconciler_fixtures import (
    at,
    creates,
    deletes,
    events,
    gang,
    make_job,
    make_node,
    make_pod,
    run,
    running_status,
    status_patch,
    two_nodes,
)
from tests.unit.test_reconciler_failures import condition

VOLCANO = {"schedulerName": "volcano", "queue": "research", "priorityClassName": "low"}


def volcano_job(**kw: Any) -> dict[str, Any]:
    return make_job(scheduling=dict(VOLCANO), **kw)


def podgroup(
    min_member: int = 4,
    phase: str = "Running",
    conditions: list[dict[str, Any]] | None = None,
    cpu: str = "4",
    running: int = 0,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "gpt", "namespace": "ml"},
        "spec": {
            "minMember": min_member,
            "minResources": {"cpu": cpu},
            "queue": "research",
            "priorityClassName": "low",
        },
        "status": {"phase": phase, "conditions": conditions or [], "running": running},
    }


UNSCHEDULABLE = {
    "type": "Unschedulable",
    "status": "True",
    "reason": "NotEnoughResources",
    "message": "3/4 tasks in gang unschedulable: pod group is not ready, 4 Pending, 4 minAvailable",
    "lastTransitionTime": "2026-01-01T12:00:05Z",
}


def preempted_pod(rank: int, exit_code: int | None = None) -> dict[str, Any]:
    pod = make_pod(
        rank, deleting=True, phase="Failed" if exit_code is not None else "Running", exit_code=exit_code
    )
    pod["status"]["conditions"] = [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Evict",
            "message": "Pod is evicted, because of preempt",
        },
        {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": "volcano: preempting to accommodate a higher priority pod",
        },
    ]
    return pod


def test_podgroup_spec_that_drifted_is_patched_back_before_pods_are_created() -> None:
    job = volcano_job(status={**running_status(), "phase": "Restarting", "generation": 1, "replicas": 3})
    stale = podgroup(min_member=4, cpu="4")
    actions = run(job, [], two_nodes(), podgroup=stale)
    kinds = [type(a).__name__ for a in actions]
    assert kinds.index("ApplyPodGroup") < kinds.index("CreatePod")
    apply = next(a for a in actions if isinstance(a, ApplyPodGroup))
    assert apply.exists and apply.manifest["spec"]["minMember"] == 3
    assert volcano.spec_differs(stale, apply.manifest) == ["minMember", "minResources"]


def test_podgroup_with_the_same_spec_in_other_units_is_left_alone() -> None:
    job = volcano_job(status=running_status())
    same = podgroup(cpu="4000m")
    actions = run(job, gang(4), two_nodes(), podgroup=same)
    assert not [a for a in actions if isinstance(a, ApplyPodGroup)]


def test_merge_patch_removes_a_queue_the_job_no_longer_names() -> None:
    wanted = {"spec": {"minMember": 2, "minResources": {"cpu": "2"}}}
    assert volcano.spec_patch(wanted) == {
        "spec": {"minMember": 2, "minResources": {"cpu": "2"}, "queue": None, "priorityClassName": None}
    }
    assert volcano.spec_differs(podgroup(), wanted) == [
        "minMember",
        "minResources",
        "queue",
        "priorityClassName",
    ]


def test_waiting_gang_shows_volcanos_last_condition_with_one_warning_per_new_message() -> None:
    job = volcano_job(status={**running_status(), "phase": "Pending"})
    pending = [make_pod(r, phase="Pending", node=None) for r in range(4)]
    group = podgroup(phase="Inqueue", conditions=[UNSCHEDULABLE])
    actions = run(job, pending, two_nodes(), now=10, podgroup=group)
    shown = condition(status_patch(actions), volcano.CONDITION)
    assert shown["status"] == "False" and shown["reason"] == "Inqueue"
    assert "Volcano PodGroup gpt is Inqueue" in shown["message"]
    assert "3/4 tasks in gang unschedulable" in shown["message"]
    (warning,) = [e for e in events(actions) if e.reason == "GangWaiting"]
    assert warning.type == "Warning" and warning.message == shown["message"]

    job["status"]["conditions"].append(shown)
    again = run(job, pending, two_nodes(), now=12, podgroup=group)
    assert not [e for e in events(again) if e.reason == "GangWaiting"], "the same message twice"


def test_scheduled_gang_turns_the_condition_true_with_one_normal_event() -> None:
    job = volcano_job(status=running_status())
    job["status"]["conditions"].append(
        {"type": volcano.CONDITION, "status": "False", "reason": "Inqueue", "message": "waiting"}
    )
    actions = run(job, gang(4), two_nodes(), podgroup=podgroup(phase="Running", conditions=[UNSCHEDULABLE]))
    shown = condition(status_patch(actions), volcano.CONDITION)
    assert shown["status"] == "True" and shown["reason"] == "Running"
    assert "unschedulable" not in shown["message"], "an old condition is not news once the gang runs"
    assert [e.type for e in events(actions) if e.reason == "GangScheduled"] == ["Normal"]


def test_waiting_without_a_reason_yet_or_about_to_run_is_not_a_warning() -> None:
    job = volcano_job(status={**running_status(), "phase": "Pending"})
    pending = [make_pod(r, phase="Pending", node=None) for r in range(4)]
    ready = {
        **UNSCHEDULABLE,
        "type": "Scheduled",
        "message": "",
        "lastTransitionTime": "2026-01-01T12:00:09Z",
    }
    for group in (podgroup(phase="Pending"), podgroup(phase="Inqueue", conditions=[UNSCHEDULABLE, ready])):
        actions = run(job, pending, two_nodes(), now=10, podgroup=group)
        assert not [e for e in events(actions) if e.reason.startswith("Gang")]
        shown = condition(status_patch(actions), volcano.CONDITION)
        assert shown["status"] == "False" and "unschedulable" not in shown["message"]


def test_a_completed_podgroup_between_generations_is_neither_placed_nor_news() -> None:
    # all members of generation 0 exited 75 after a preemption: Volcano calls that Completed
    job = volcano_job(status={**running_status(), "phase": "Restarting", "generation": 1})
    job["status"]["conditions"].append(
        {"type": volcano.CONDITION, "status": "True", "reason": "Running", "message": "placed"}
    )
    actions = run(job, [], two_nodes(), podgroup=podgroup(phase="Completed"))
    shown = condition(status_patch(actions), volcano.CONDITION)
    assert shown["status"] == "False" and shown["reason"] == "Completed"
    assert not [e for e in events(actions) if e.reason.startswith("Gang")]


def test_the_pass_that_finishes_the_job_keeps_the_gang_view_of_its_run() -> None:
    job = volcano_job(status=running_status())
    job["status"]["conditions"].append(
        {"type": volcano.CONDITION, "status": "True", "reason": "Running", "message": "placed"}
    )
    done = [make_pod(r, phase="Succeeded", exit_code=0) for r in range(4)]
    patch = status_patch(run(job, done, two_nodes(), podgroup=podgroup(phase="Completed")))
    assert patch["phase"] == "Succeeded"
    assert condition(patch, volcano.CONDITION)["reason"] == "Running", "not Completed"


def test_last_condition_is_the_newest_one() -> None:
    older = {**UNSCHEDULABLE, "message": "old", "lastTransitionTime": "2026-01-01T11:00:00Z"}
    group = podgroup(conditions=[UNSCHEDULABLE, older])
    assert volcano.last_condition(group) == UNSCHEDULABLE
    assert volcano.last_condition(podgroup()) is None


def test_preempted_worker_restarts_uncounted_and_its_peers_get_their_full_grace() -> None:
    job = volcano_job(status=running_status(restarts=1))
    pods = gang(4)
    pods[2] = preempted_pod(2)
    actions = run(job, pods, two_nodes(), podgroup=podgroup())
    patch = status_patch(actions)
    assert patch["generation"] == 1 and "restarts" not in patch
    restarting = condition(patch, "Restarting")
    assert restarting["reason"] == "Preempted"
    assert "gpt-worker-2 was preempted: volcano: preempting" in restarting["message"]
    assert not any(isinstance(a, CountRestart) for a in actions)
    assert [e.type for e in events(actions) if e.reason == "Preempted"] == ["Normal"]
    # the peers checkpoint first (SIGTERM, their own grace period); the preempted one is already going
    assert {d.name: d.grace_seconds for d in deletes(actions)} == {
        "gpt-worker-0": None,
        "gpt-worker-1": None,
        "gpt-worker-3": None,
    }


def test_preempted_worker_killed_after_its_grace_is_still_not_a_failure() -> None:
    job = volcano_job(status=running_status())
    pods = [make_pod(r, phase="Failed", exit_code=75) for r in range(4)]
    pods[1] = preempted_pod(1, exit_code=137)
    patch = status_patch(run(job, pods, two_nodes(), podgroup=podgroup()))
    assert condition(patch, "Restarting")["reason"] == "Preempted" and "restarts" not in patch


def test_preemption_at_a_fixed_size_waits_at_that_size() -> None:
    # the high-priority job took a node: only 2 workers fit, but minReplicas is 4
    job = volcano_job(status=running_status(), replicas=4, min_replicas=4, max_replicas=4)
    pods = gang(4)
    pods[0] = preempted_pod(0)
    other = [make_pod(r, job="high", node="n1") for r in range(2)]
    patch = status_patch(run(job, pods, two_nodes(), podgroup=podgroup(), node_pods=pods + other))
    assert patch["generation"] == 1 and "replicas" not in patch, "the next generation keeps 4 workers"
    assert condition(patch, "Restarting")["reason"] == "Preempted"


def test_waiting_volcano_gang_that_fits_is_not_shrunk_after_the_timeout() -> None:
    # queue capability or priority hold it; the nodes have room for all 4
    job = volcano_job(status={**running_status(), "phase": "Pending"})
    pending = [make_pod(r, phase="Pending", node=None) for r in range(4)]
    nodes = [make_node("n1", cpu="4"), make_node("n2", cpu="4")]
    actions = run(job, pending, nodes, now=600, podgroup=podgroup(phase="Inqueue"))
    assert "generation" not in status_patch(actions) and not deletes(actions)


def test_waiting_volcano_gang_that_does_not_fit_shrinks_to_what_does() -> None:
    job = volcano_job(status={**running_status(), "phase": "Pending"})
    pending = [make_pod(r, phase="Pending", node=None) for r in range(4)]
    actions = run(job, pending, [make_node("n1", cpu="3")], now=600, podgroup=podgroup(phase="Inqueue"))
    patch = status_patch(actions)
    assert patch["generation"] == 1 and patch["replicas"] == 3
    assert condition(patch, "Restarting")["reason"] == "Unschedulable"
    assert creates(actions) == []


def _bound(pod: dict[str, Any], seconds: float) -> dict[str, Any]:
    pod["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": to_rfc3339(at(seconds))}
    ]
    return pod


def test_pod_bound_after_its_node_went_not_ready_is_on_a_lost_node_only_once_the_view_caught_up() -> None:
    # the operator's view of n2 lags: n2 came back a moment ago and the scheduler bound to it
    job = volcano_job(status={**running_status(), "phase": "Pending"})
    stale = make_node("n2", ready=False)
    stale["status"]["conditions"][0]["lastTransitionTime"] = to_rfc3339(at(50))
    nodes = [make_node("n1"), stale]
    pods = [_bound(make_pod(r, node="n1" if r < 3 else "n2", phase="Pending"), 90) for r in range(4)]
    actions = run(job, pods, nodes, now=91, podgroup=podgroup())
    assert "generation" not in status_patch(actions) and not deletes(actions)
    # 10 s after the binding (node_view_lag_seconds) the view still says NotReady: the scheduler
    # bound in the moment before the node's taint, and the node is lost after all
    patch = status_patch(run(job, pods, nodes, now=100, podgroup=podgroup()))
    assert condition(patch, "Restarting")["reason"] == "NodeLost"
    # bound before the node was lost: it is lost with it
    pods[3] = _bound(make_pod(3, node="n2"), 40)
    patch = status_patch(run(job, pods, nodes, now=91, podgroup=podgroup()))
    assert condition(patch, "Restarting")["reason"] == "NodeLost"


def volcano_queue(
    state: str = "Open", capability: dict[str, str] | None = None, cpu: str = "0"
) -> dict[str, Any]:
    return {
        "metadata": {"name": "research"},
        "spec": {"capability": capability} if capability else {},
        "status": {"state": state, "allocated": {"cpu": cpu}},
    }


def test_waiting_gang_says_when_its_queue_is_full_closed_or_missing() -> None:
    job = volcano_job(status={**running_status(), "phase": "Pending"})
    pending = [make_pod(r, phase="Pending", node=None) for r in range(4)]
    group = podgroup(phase="Inqueue", conditions=[UNSCHEDULABLE])

    def said(**observed: Any) -> str:
        actions = run(job, pending, two_nodes(), now=10, podgroup=group, **observed)
        return str(condition(status_patch(actions), volcano.CONDITION)["message"])

    full = said(queue=volcano_queue(capability={"cpu": "6", "memory": "8Gi"}, cpu="4"))
    assert "Volcano queue research is full (cpu 4 of 6 in use, the gang needs 4)" in full
    assert "3/4 tasks in gang unschedulable" in full, "Volcano's own reason stays"
    assert "queue research is Closed" in said(queue=volcano_queue(state="Closed"))
    assert "queue research does not exist" in said(queue_missing=True)
    roomy = said(queue=volcano_queue(capability={"cpu": "8"}, cpu="4"))
    assert "Volcano queue" not in roomy and "3/4 tasks in gang unschedulable" in roomy
    assert "full" not in said(), "no queue read (an install without the right): nothing claimed"
    # members bound, PodGroup still Inqueue: the queue's allocation is this gang's own
    pending[0] = make_pod(0, phase="Pending", node="n1")
    assert "full" not in said(queue=volcano_queue(capability={"cpu": "6", "memory": "8Gi"}, cpu="4"))
