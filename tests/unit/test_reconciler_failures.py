"""The reconciler when workers fail: new generations, restart limits, exit codes, lost nodes."""

from __future__ import annotations

from typing import Any

from dtjob.operator.actions import CountRestart, ObserveRecovery
from dtjob.operator.nodes import (
    LOST_RANK_GRACE_SECONDS,
    SILENT_KUBELET_SECONDS,
    SILENT_LOST_RANK_SECONDS,
)
from dtjob.operator.reconciler import plan
from dtjob.operator.settings import ReconcilerSettings
from tests.unit.reconciler_fixtures import (
    at,
    creates,
    deletes,
    env_of,
    events,
    gang,
    make_job,
    make_node,
    make_pod,
    observed,
    run,
    running_status,
    status_patch,
    two_nodes,
)


def condition(patch: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in patch["conditions"] if c["type"] == ctype)


def test_failed_worker_starts_a_counted_new_generation_and_stops_the_rest_with_a_short_grace() -> None:
    job = make_job(status=running_status())
    pods = gang(4)
    pods[2] = make_pod(2, node="n2", phase="Failed", exit_code=1)
    actions = run(job, pods, two_nodes())
    patch = status_patch(actions)
    assert patch["phase"] == "Restarting" and patch["generation"] == 1 and patch["restarts"] == 1
    assert "replicas" not in patch, "same world size: 4 still fit"
    assert condition(patch, "Restarting")["reason"] == "WorkerFailed"
    assert "gpt-worker-2 failed (exit code 1)" in condition(patch, "Restarting")["message"]
    graceful = {d.name: d.grace_seconds for d in deletes(actions)}
    # SIGTERM with a short grace: survivors of a failure cannot checkpoint without their peer
    assert graceful == {"gpt-worker-0": 5, "gpt-worker-1": 5, "gpt-worker-2": 0, "gpt-worker-3": 5}
    assert CountRestart("WorkerFailed") in actions
    assert creates(actions) == [], "the new gang waits until the old pods are gone (same names)"
    assert [(e.type, e.reason) for e in events(actions)] == [("Warning", "WorkerFailed")]


def test_new_generation_is_created_once_the_old_pods_are_gone() -> None:
    status = {**running_status(generation=1, restarts=1), "phase": "Restarting"}
    job = make_job(status=status)
    old = gang(4, generation=0, deleting=True)
    assert creates(run(job, old, two_nodes())) == []
    assert deletes(run(job, old, two_nodes())) == [], "already terminating: no second delete"
    actions = run(job, [], two_nodes())
    made = creates(actions)
    assert len(made) == 4
    assert all(c.manifest["metadata"]["labels"]["training.dtjob.io/generation"] == "1" for c in made)
    assert env_of(made[0].manifest)["DTJOB_GENERATION"] == "1"


def test_recovery_time_is_observed_when_the_restarted_gang_runs() -> None:
    job = make_job(status={**running_status(generation=1, restarts=1), "phase": "Restarting"})
    job["status"]["conditions"] = [
        {
            "type": "Restarting",
            "status": "True",
            "reason": "WorkerFailed",
            "message": "",
            "lastTransitionTime": "2026-01-01T12:01:00Z",
        },
    ]
    actions = run(job, gang(4, generation=1), two_nodes(), now=75)
    assert status_patch(actions)["phase"] == "Running"
    assert ObserveRecovery(15.0) in actions


def test_restart_beyond_max_restarts_fails_with_the_reason() -> None:
    job = make_job(max_restarts=2, status=running_status(restarts=2))
    pods = gang(4)
    pods[1] = make_pod(1, phase="Failed", exit_code=137)
    actions = run(job, pods, two_nodes())
    patch = status_patch(actions)
    assert patch["phase"] == "Failed" and patch["restarts"] == 3
    failed = condition(patch, "Failed")
    assert failed["reason"] == "MaxRestartsExceeded"
    assert "maxRestarts=2" in failed["message"] and "exit code 137" in failed["message"]
    assert "completionTime" in patch
    assert len(deletes(actions)) == 3, "cleanPodPolicy Running stops the survivors"


def test_permanent_exit_code_fails_at_once_even_with_restarts_left() -> None:
    job = make_job(max_restarts=10, status=running_status())
    pods = gang(4)
    pods[3] = make_pod(3, phase="Failed", exit_code=2)
    patch = status_patch(run(job, pods, two_nodes()))
    assert patch["phase"] == "Failed"
    assert condition(patch, "Failed")["reason"] == "PermanentError"
    assert "restarts" not in patch


def test_permanent_exit_codes_come_from_the_spec_when_given() -> None:
    job = make_job(status=running_status(), elastic={"permanentExitCodes": [42]})
    pods = gang(4)
    pods[3] = make_pod(3, phase="Failed", exit_code=2)
    assert status_patch(run(job, pods, two_nodes()))["phase"] == "Restarting"
    pods[3] = make_pod(3, phase="Failed", exit_code=42)
    assert status_patch(run(job, pods, two_nodes()))["phase"] == "Failed"


def test_restart_policy_never_fails_on_any_failure_and_on_failure_always_restarts() -> None:
    pods = gang(4)
    pods[3] = make_pod(3, phase="Failed", exit_code=2)
    never = status_patch(
        run(make_job(status=running_status(), elastic={"restartPolicy": "Never"}), pods, two_nodes())
    )
    assert never["phase"] == "Failed" and condition(never, "Failed")["reason"] == "RestartPolicyNever"
    always = make_job(status=running_status(), elastic={"restartPolicy": "OnFailure"})
    assert status_patch(run(always, pods, two_nodes()))["phase"] == "Restarting"


def test_worker_that_stopped_with_a_checkpoint_restarts_uncounted() -> None:
    job = make_job(status=running_status(restarts=1))
    pods = gang(4)
    pods[0] = make_pod(0, phase="Failed", exit_code=75)
    actions = run(job, pods, two_nodes())
    patch = status_patch(actions)
    assert patch["generation"] == 1 and "restarts" not in patch
    assert not any(isinstance(a, CountRestart) for a in actions)


def test_deleted_worker_restarts_the_gang() -> None:
    job = make_job(status=running_status())
    pods = gang(4)
    pods[1] = make_pod(1, deleting=True)
    patch = status_patch(run(job, pods, two_nodes()))
    assert condition(patch, "Restarting")["reason"] == "WorkerDeleted" and patch["restarts"] == 1


def test_not_ready_node_force_deletes_its_pods_and_shrinks_to_what_fits() -> None:
    job = make_job(status=running_status())
    nodes = [make_node("n1"), make_node("n2", ready=False)]
    actions = run(job, gang(4), nodes)
    patch = status_patch(actions)
    assert condition(patch, "Restarting")["reason"] == "NodeLost"
    assert patch["replicas"] == 2, "n1 has 2 cpus for 1-cpu workers"
    grace = {d.name: d.grace_seconds for d in deletes(actions)}
    assert grace == {"gpt-worker-0": 5, "gpt-worker-1": 5, "gpt-worker-2": 0, "gpt-worker-3": 0}


def test_vanished_node_is_a_lost_node_and_terminating_pods_there_are_forced() -> None:
    job = make_job(status={**running_status(generation=1, restarts=1), "phase": "Restarting"})
    old = gang(4, generation=0, deleting=True)
    actions = run(job, old, [make_node("n1")])  # n2 is gone
    assert {d.name: d.grace_seconds for d in deletes(actions)} == {"gpt-worker-2": 0, "gpt-worker-3": 0}


def test_never_below_min_replicas_waits_saying_so() -> None:
    job = make_job(min_replicas=3, status=running_status())
    nodes = [make_node("n1"), make_node("n2", ready=False)]
    patch = status_patch(run(job, gang(4), nodes))
    assert patch["replicas"] == 3
    schedulable = condition(patch, "Schedulable")
    assert schedulable["status"] == "False" and schedulable["reason"] == "InsufficientCapacity"
    assert "minReplicas=3" in schedulable["message"]


def test_old_generation_failures_are_not_new_failures() -> None:
    job = make_job(status={**running_status(generation=1, restarts=1), "phase": "Restarting"})
    old = [make_pod(r, generation=0, phase="Failed", exit_code=1) for r in range(4)]
    actions = run(job, old, two_nodes())
    assert "generation" not in status_patch(actions)
    assert {d.grace_seconds for d in deletes(actions)} == {0}


def test_a_deletion_its_kubelet_leaves_unfinished_is_forced_and_the_next_gang_avoids_the_node() -> None:
    """A node that stopped silently still looks Ready for 20-50 s: its pods' graceful deletions
    never finish, and the scheduler would place the next gang there again."""
    status = {**running_status(generation=1, restarts=1), "phase": "Restarting"}
    job = make_job(status=status)
    old = [
        make_pod(0, 0, node="n1", deleting=True, grace_ends=95.0),
        make_pod(1, 0, node="n2", deleting=True, grace_ends=96.0),
        make_pod(2, 0, node="n1", deleting=True, grace_ends=94.0),
    ]
    assert SILENT_KUBELET_SECONDS == 5
    within = run(job, old[:2], two_nodes(), now=99.5)  # 4.5 s past n1's grace: not yet
    assert deletes(within) == [] and creates(within) == []
    lease = "2026-01-01T12:01:33.250000Z"  # n1's kubelet renewed its Lease last before it stopped
    actions = run(job, old, two_nodes(), now=100.5, leases={"n1": lease, "n2": "2026-01-01T12:01:40.0Z"})
    assert [(d.name, d.grace_seconds) for d in deletes(actions)] == [("gpt-worker-0", 0), ("gpt-worker-2", 0)]
    [silent] = [e for e in events(actions) if e.reason == "NodeSilent"]  # one per node
    assert silent.type == "Warning" and "node n1" in silent.message and "gpt-worker-0" in silent.message
    assert status_patch(actions)["silentNodes"] == [
        {"name": "n1", "since": "2026-01-01T12:01:40Z", "leaseRenewTime": lease}
    ]
    assert creates(actions) == [], "gpt-worker-1 is still in its grace period"

    # The old pods gone: the next gang avoids n1 (and fits in n2's 2 cpus: 2 workers, not 4), and
    # the operator looks at n1's Lease again at every tick (no watch announces a renewal).
    job = make_job(status={**status, **status_patch(actions)})
    decided = plan(observed(job, [], two_nodes(), now=101.0, leases={"n1": lease}), ReconcilerSettings())
    made = creates(decided.actions)
    assert len(made) == 2 and decided.poll
    for c in made:
        affinity = c.manifest["spec"]["affinity"]["nodeAffinity"]
        assert affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n1"]}]}
        ]
    # 120 s later, once n1 turned NotReady, is Ready again after a transition, or renewed its Lease
    # (its kubelet is alive: a loaded one taken for silent), it is trusted again.
    back = make_node("n1")
    back["status"]["conditions"][0]["lastTransitionTime"] = "2026-01-01T12:01:50Z"  # after `since`
    renewed = {"n1": "2026-01-01T12:01:37.100000Z"}  # any other renewTime: the node's clock may be off
    down = [make_node("n1", ready=False), make_node("n2")]
    cases = [
        (two_nodes(), 221.0, {}),
        (down, 101.0, {}),
        ([back, make_node("n2")], 111.0, {}),
        (two_nodes(), 101.0, renewed),
    ]
    for nodes, now, leases in cases:
        later = run(job, [], nodes, now=now, leases=leases)
        assert status_patch(later).get("silentNodes") == []
        assert all("affinity" not in c.manifest["spec"] for c in creates(later))
    # Without a Lease read at the time (none, or not readable), only the other three count.
    unread = {**status, "silentNodes": [{"name": "n1", "since": "2026-01-01T12:01:40Z"}]}
    decided = plan(
        observed(make_job(status=unread), [], two_nodes(), now=101.0, leases=renewed), ReconcilerSettings()
    )
    assert len(creates(decided.actions)) == 2 and not decided.poll


def test_a_rank_its_peers_declared_lost_is_taken_for_silent_sooner() -> None:
    """Deleted with LOST_RANK_GRACE_SECONDS (hung, cut off or on a dead node): 2 s past its grace,
    not 5 s; a survivor's deletion (5 s grace) on the same node still gets the 5 s."""
    status = {**running_status(generation=1, restarts=1), "phase": "Restarting"}
    lost = make_pod(1, 0, node="n1", deleting=True, grace_ends=97.0, grace=LOST_RANK_GRACE_SECONDS)
    survivor = make_pod(0, 0, node="n2", deleting=True, grace_ends=97.0, grace=5)
    assert SILENT_LOST_RANK_SECONDS == 2
    decided = plan(
        observed(make_job(status=status), [lost, survivor], two_nodes(), now=98.5), ReconcilerSettings()
    )
    assert deletes(decided.actions) == [] and decided.wake_at == at(99.0)
    actions = run(make_job(status=status), [lost, survivor], two_nodes(), now=99.0)
    assert [(d.name, d.grace_seconds) for d in deletes(actions)] == [("gpt-worker-1", 0)]
    [silent] = [e for e in events(actions) if e.reason == "NodeSilent"]
    assert "unfinished 2s past its grace" in silent.message


def test_a_node_lost_or_deleted_pods_are_not_taken_for_a_silent_kubelet() -> None:
    status = {**running_status(generation=1, restarts=1), "phase": "Restarting"}
    job = make_job(status=status)
    old = [make_pod(0, 0, node="n1", deleting=True, grace_ends=10.0)]
    actions = run(job, old, [make_node("n1", ready=False), make_node("n2")])
    assert [(d.name, d.grace_seconds) for d in deletes(actions)] == [("gpt-worker-0", 0)]
    assert not [e for e in events(actions) if e.reason == "NodeSilent"], "a NotReady node is lost, not silent"
    assert not status_patch(actions).get("silentNodes")


def test_a_new_generation_is_sized_to_what_fits_beside_the_silent_nodes() -> None:
    status = {**running_status(), "silentNodes": [{"name": "n1", "since": "2026-01-01T12:01:30Z"}]}
    pods = gang(4)
    pods[2] = make_pod(2, node="n2", phase="Failed", exit_code=1)
    patch = status_patch(run(make_job(status=status), pods, two_nodes(), now=100.0))
    assert patch["generation"] == 1 and patch["replicas"] == 2, "n2's 2 cpus, not n1's"


def test_a_restarted_generation_shrinks_to_what_fits_beside_a_node_found_silent_before_its_pods() -> None:
    # One 2-cpu worker per node: n1 is found silent after the restart was sized at 2 workers.
    status = {**running_status(size=2, generation=1, restarts=1), "phase": "Restarting"}
    job = make_job(replicas=2, min_replicas=1, max_replicas=2, cpu="2", status=status)
    old = [make_pod(0, 0, node="n1", deleting=True, grace_ends=90.0)]
    actions = run(job, old, two_nodes(), now=100.0)
    assert status_patch(actions)["silentNodes"][0]["name"] == "n1" and creates(actions) == []
    job = make_job(
        replicas=2, min_replicas=1, max_replicas=2, cpu="2", status={**status, **status_patch(actions)}
    )
    actions = run(job, [], two_nodes(), now=101.0)  # the old pod gone
    patch = status_patch(actions)
    assert (patch["replicas"], patch["worldSize"]) == (1, 1)
    made = creates(actions)
    assert len(made) == 1 and env_of(made[0].manifest)["WORLD_SIZE"] == "1"
    assert [e.reason for e in events(actions)] == ["Rescale"]
    # Never below minReplicas: at min 2 the generation keeps its size (and waits for capacity).
    silent = {"silentNodes": [{"name": "n1", "since": "2026-01-01T12:01:40Z"}]}
    job = make_job(replicas=2, min_replicas=2, max_replicas=2, cpu="2", status={**status, **silent})
    assert len(creates(run(job, [], two_nodes(), now=101.0))) == 2


# --- a failure says why (issue #46) ---------------------------------------------------------------
def _failed_with_log(rank: int, code: int, message: str) -> dict[str, Any]:
    """A failed worker whose terminated state carries `message`, as FallbackToLogsOnError does."""
    pod = make_pod(rank, phase="Failed", exit_code=code)
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message
    return pod


def test_a_failed_workers_exit_code_and_last_log_line_are_on_its_event_and_condition() -> None:
    job = make_job(status=running_status())
    pods = gang(4)
    error = "OSError: [Errno 30] Read-only file system: '/ckpt'"
    log = f"step 1 loss 5.5\nTraceback (most recent call last):\n{error}\n"
    pods[2] = _failed_with_log(2, 1, log)
    actions = run(job, pods, two_nodes())
    said = f"gpt-worker-2 failed (exit code 1): {error}"
    assert said in condition(status_patch(actions), "Restarting")["message"]
    assert [e.message for e in events(actions)] == [f"generation 1 with 4 workers: {said}"]


def test_the_last_line_comes_from_the_log_read_when_the_pod_has_no_message() -> None:
    job = make_job(status=running_status())
    pods = gang(4)
    pods[1] = make_pod(1, phase="Failed", exit_code=1)
    logs = {
        "gpt-worker-1": "RuntimeError: CUDA error: out of memory\nrestarts in place in this generation: 0\n"
    }
    patch = status_patch(run(job, pods, two_nodes(), worker_logs=logs))
    assert condition(patch, "Restarting")["message"].endswith(
        "gpt-worker-1 failed (exit code 1): RuntimeError: CUDA error: out of memory"
    ), "the agent's bookkeeping line is not the cause"


def test_a_permanent_failure_names_its_exit_code_and_last_line() -> None:
    job = make_job(max_restarts=10, status=running_status())
    pods = gang(4)
    pods[3] = _failed_with_log(3, 2, "dtjob: --model: unknown model 'gtp'\n")
    failed = condition(status_patch(run(job, pods, two_nodes())), "Failed")
    assert failed["reason"] == "PermanentError"
    assert failed["message"] == (
        "gpt-worker-3 failed (exit code 2): dtjob: --model: unknown model 'gtp'; "
        "exit code 2 is permanent (permanentExitCodes)"
    )
