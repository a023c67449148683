"""The reconciler from creation to completion: start, running, success, run policy, status."""

from __future__ import annotations

from dtjob.operator.actions import (
    ApplyPodGroup,
    CreatePod,
    CreateService,
    DeleteJob,
    ObserveRecovery,
    PatchStatus,
)
from dtjob.operator.progress import TrainerProgress
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
    make_pod,
    run,
    running_status,
    status_patch,
    two_nodes,
)


def test_new_job_starts_generation_zero_with_service_first_then_every_rank() -> None:
    actions = run(make_job(), pods=[], nodes=two_nodes(), service_exists=False, now=5)
    status = status_patch(actions)
    assert status["phase"] == "Pending"
    assert status["generation"] == 0 and status["restarts"] == 0 and status["replicas"] == 4
    assert status["selector"] == "training.dtjob.io/job-name=gpt"
    assert status["startTime"] == to_rfc3339(at(5))
    assert isinstance(actions[2], CreateService), "status, its event, then the Service before any pod"
    pods = creates(actions)
    assert [p.name for p in pods] == [f"gpt-worker-{r}" for r in range(4)]
    assert env_of(pods[3].manifest)["RANK"] == "3"
    assert env_of(pods[3].manifest)["WORLD_SIZE"] == "4"
    assert [e.reason for e in events(actions)] == ["Created"]


def test_pods_created_after_an_operator_crash_are_only_the_missing_ranks() -> None:
    job = make_job(status={**running_status(), "phase": "Pending"})
    pods = [make_pod(0, phase="Pending"), make_pod(2, phase="Pending")]
    actions = run(job, pods, two_nodes())
    assert sorted(p.name for p in creates(actions)) == ["gpt-worker-1", "gpt-worker-3"]
    assert deletes(actions) == []


def test_gang_all_running_moves_to_running_once() -> None:
    job = make_job(status={**running_status(), "phase": "Pending", "conditions": []})
    actions = run(job, gang(4), two_nodes())
    assert status_patch(actions)["phase"] == "Running"
    assert [e.reason for e in events(actions)] == ["Running"]
    assert not any(isinstance(a, ObserveRecovery) for a in actions), "a first start is no recovery"
    # Steady state: the same observation after the patch asks for nothing.
    assert run(applied(job, actions), gang(4), two_nodes()) == []


def test_reconcile_is_pure_same_observation_same_actions() -> None:
    job = make_job(status={**running_status(), "phase": "Pending"})
    pods = [make_pod(0), make_pod(1, phase="Failed", exit_code=1)]
    assert run(job, pods, two_nodes()) == run(job, pods, two_nodes())


def test_all_workers_exit_zero_succeeds_and_keeps_finished_pods() -> None:
    status = {**running_status(), "step": 48, "lastCheckpoint": {"step": 50}}
    job = make_job(status=status)
    pods = gang(4, phase="Succeeded", exit_code=0)
    actions = run(job, pods, two_nodes(), now=200)
    patch = status_patch(actions)
    assert patch["phase"] == "Succeeded"
    assert patch["completionTime"] == to_rfc3339(at(200))
    assert patch["step"] == 50, "the final step is the final checkpoint's when the last scrape missed it"
    assert deletes(actions) == [], "cleanPodPolicy Running keeps finished pods for their logs"
    assert [e.reason for e in events(actions)] == ["Succeeded"]


def test_some_workers_done_others_running_waits() -> None:
    job = make_job(status={**running_status(), "readyReplicas": 2})
    pods = [*gang(2, phase="Succeeded", exit_code=0), make_pod(2), make_pod(3)]
    assert run(job, pods, two_nodes()) == []


def test_clean_pod_policy_all_deletes_finished_pods() -> None:
    job = make_job(status={**running_status(), "phase": "Succeeded"}, runPolicy={"cleanPodPolicy": "All"})
    actions = run(job, gang(4, phase="Succeeded", exit_code=0), two_nodes())
    assert len(deletes(actions)) == 4


def test_ttl_after_finished_deletes_the_job_only_when_due() -> None:
    status = {**running_status(), "phase": "Failed", "completionTime": to_rfc3339(at(100))}
    job = make_job(status=status, runPolicy={"ttlSecondsAfterFinished": 60})
    assert run(job, [], two_nodes(), now=159) == []
    assert [type(a) for a in run(job, [], two_nodes(), now=160)] == [DeleteJob]


def test_active_deadline_fails_the_job_and_stops_its_pods() -> None:
    job = make_job(status=running_status(), runPolicy={"activeDeadlineSeconds": 50, "cleanPodPolicy": "None"})
    assert run(job, gang(4), two_nodes(), now=50) == []
    actions = run(job, gang(4), two_nodes(), now=51)
    patch = status_patch(actions)
    assert patch["phase"] == "Failed"
    failed = next(c for c in patch["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded" and "activeDeadlineSeconds=50" in failed["message"]
    assert len(deletes(actions)) == 4


def test_suspend_stops_workers_gracefully_and_resume_continues_uncounted() -> None:
    job = make_job(status=running_status(restarts=1), runPolicy={"suspend": True})
    actions = run(job, gang(4), two_nodes())
    assert status_patch(actions)["phase"] == "Suspended"
    assert all(d.grace_seconds is None for d in deletes(actions)), "SIGTERM so the trainer checkpoints"
    assert len(deletes(actions)) == 4
    suspended = applied(job, actions)
    # Exited workers (75 after their checkpoint) are removed; nothing is created while suspended.
    actions = run(suspended, gang(4, phase="Failed", exit_code=75), two_nodes())
    assert creates(actions) == [] and len(deletes(actions)) == 4
    suspended["spec"]["runPolicy"]["suspend"] = False
    actions = run(suspended, [], two_nodes(), now=300)
    patch = status_patch(actions)
    assert patch["phase"] == "Pending" and patch["generation"] == 1
    assert "restarts" not in patch, "a resume is not a restart"
    assert patch["startTime"] == to_rfc3339(at(300))
    assert [env_of(c.manifest)["DTJOB_GENERATION"] for c in creates(actions)] == ["1"] * 4


def test_job_created_suspended_creates_nothing() -> None:
    actions = run(make_job(runPolicy={"suspend": True}), [], two_nodes(), service_exists=False)
    assert status_patch(actions)["phase"] == "Suspended"
    assert creates(actions) == []


def test_trainer_metrics_fill_step_and_last_checkpoint() -> None:
    job = make_job(status=running_status())
    metrics = TrainerProgress(
        step=17, checkpoint_step=15, checkpoint_time=at(90).timestamp(), checkpoints_published=True
    )
    actions = run(job, gang(4), two_nodes(), progress=metrics)
    step_at = to_rfc3339(at(100))
    checkpoint = {"step": 15, "time": to_rfc3339(at(90))}
    assert actions == [PatchStatus({"step": 17, "lastCheckpoint": checkpoint, "lastProgressTime": step_at})]


def test_invalid_spec_creates_nothing_and_says_why_once() -> None:
    job = make_job(replicas=4, max_replicas=3)
    actions = run(job, [], two_nodes(), service_exists=False)
    valid = next(c for c in status_patch(actions)["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and "maxReplicas" in valid["message"]
    assert [(e.type, e.reason) for e in events(actions)] == [("Warning", "InvalidSpec")]
    assert len(actions) == 2, "no pod, no service"
    assert run(applied(job, actions), [], two_nodes()) == [], "the same problem is reported once"


def test_a_starting_trainer_reporting_step_zero_does_not_reset_the_step() -> None:
    job = make_job(
        status={**running_status(), "step": 40, "lastCheckpoint": {"step": 40, "time": to_rfc3339(at(90))}}
    )
    starting = TrainerProgress(step=0, checkpoint_step=0, checkpoints_published=True)
    assert run(job, gang(4), two_nodes(), progress=starting) == []


def test_deleted_job_is_left_to_garbage_collection() -> None:
    job = make_job(status=running_status())
    job["metadata"]["deletionTimestamp"] = to_rfc3339(at(1))
    assert run(job, [make_pod(0, phase="Failed", exit_code=1)], two_nodes()) == []


def test_volcano_job_gets_its_podgroup_before_its_pods() -> None:
    job = make_job(scheduling={"schedulerName": "volcano", "queue": "research", "priorityClassName": "high"})
    actions = run(job, [], two_nodes())
    kinds = [type(a).__name__ for a in actions]
    assert kinds.index("ApplyPodGroup") < kinds.index("CreatePod")
    group = next(a for a in actions if isinstance(a, ApplyPodGroup))
    assert group.manifest["spec"] == {
        "minMember": 4,
        "minResources": {"cpu": "4"},
        "queue": "research",
        "priorityClassName": "high",
    }
    pod = next(a for a in actions if isinstance(a, CreatePod)).manifest
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "gpt"


def test_spec_the_model_rejects_is_reported_not_raised() -> None:
    job = make_job()
    del job["spec"]["template"]  # required; only an API server without the CRD's schema lets it in
    job["spec"]["masterPort"] = 0
    actions = run(job, [], two_nodes(), service_exists=False)
    valid = next(c for c in status_patch(actions)["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False"
    assert "spec.template" in valid["message"] and "spec.masterPort" in valid["message"]
    assert creates(actions) == []
