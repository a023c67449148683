"""The reconciler and what the trainer tells it: a lost peer (exit 76), a progress deadline, what
the trainer publishes (MetricsAvailable), and what the operator waits for (Waiting)."""

from __future__ import annotations

from typing import Any

from dtjob import contract
from dtjob.operator.actions import CountRestart
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.settings import ReconcilerSettings
from dtjob.operator.timefmt import to_rfc3339
from tests.unit.reconciler_fixtures import (
    applied,
    at,
    condition,
    creates,
    deletes,
    events,
    gang,
    make_job,
    make_pod,
    run,
    running_status,
    status_patch,
    two_nodes,
    waiting,
)

DTJOB_TRAINER = TrainerProgress(
    step=12, checkpoint_step=10, checkpoint_time=at(90).timestamp(), checkpoints_published=True
)


def survivors_of_rank_2(log: str | None, message: str | None = None) -> list[dict[str, Any]]:
    """Ranks 0, 1, 3 exited 76; rank 2 hangs (still Running, SIGSTOPped)."""
    pods = gang(4)
    for rank in (0, 1, 3):
        pods[rank] = make_pod(rank, node=pods[rank]["spec"]["nodeName"], phase="Failed", exit_code=76)
        if message is not None:
            terminated = pods[rank]["status"]["containerStatuses"][0]["state"]["terminated"]
            terminated["message"] = message
    return pods


def logs(line: str) -> dict[str, str]:
    return {f"gpt-worker-{r}": f"INFO step 12\nERROR {line}\n" for r in (0, 1, 3)}


# --- a lost peer -------------------------------------------------------------------------------
def test_survivors_exiting_76_restart_the_gang_counted_naming_the_lost_rank() -> None:
    job = make_job(status=running_status())
    actions = run(
        job, survivors_of_rank_2(None), two_nodes(), worker_logs=logs(contract.peer_lost_line(2, 10.2))
    )
    patch = status_patch(actions)
    assert (patch["generation"], patch["restarts"]) == (1, 1)
    restarting = condition(actions, "Restarting") or {}
    assert restarting["reason"] == "PeerLost"
    assert restarting["message"] == (
        "generation 1 with 4 workers: rank 2 (gpt-worker-2) lost: no heartbeat for 10s "
        "(gpt-worker-0, gpt-worker-1, gpt-worker-3 exited 76)"
    )
    assert [(e.type, e.reason) for e in events(actions)] == [("Warning", "PeerLost")]
    assert CountRestart("PeerLost") in actions
    # The survivors have exited (forced); the lost rank (hung, cut off, or on a silent node) gets
    # a second: a live kubelet kills it at once, a silent node keeps it until its NotReady.
    graceful = {d.name: d.grace_seconds for d in deletes(actions)}
    assert graceful == {"gpt-worker-0": 0, "gpt-worker-1": 0, "gpt-worker-2": 1, "gpt-worker-3": 0}
    assert "rank 2 lost by its peers" in next(d for d in deletes(actions) if d.name == "gpt-worker-2").reason


def test_the_lost_rank_comes_from_the_termination_message_too_and_may_be_unknown() -> None:
    job = make_job(status=running_status(), elastic={"heartbeatTimeoutSeconds": 4})
    from_message = run(job, survivors_of_rank_2(None, message=contract.peer_lost_line(2, 4.0)), two_nodes())
    assert (
        "rank 2 (gpt-worker-2) lost: no heartbeat for 4s"
        in (condition(from_message, "Restarting") or {})["message"]
    )
    unnamed = run(job, survivors_of_rank_2(None), two_nodes())
    graceful = {d.name: d.grace_seconds for d in deletes(unnamed)}
    assert graceful["gpt-worker-2"] == 5, "no rank named: the one still running gets its grace period"
    message = (condition(unnamed, "Restarting") or {})["message"]
    assert message.endswith(
        "gpt-worker-0, gpt-worker-1, gpt-worker-3 exited 76: a peer stopped answering "
        "(no rank named in the log)"
    )
    assert status_patch(unnamed)["restarts"] == 1


def test_a_crash_is_the_cause_its_survivors_exiting_76_are_not() -> None:
    job = make_job(status=running_status())
    pods = survivors_of_rank_2(None)
    pods[2] = make_pod(2, node="n2", phase="Failed", exit_code=1)
    actions = run(job, pods, two_nodes(), worker_logs=logs(contract.peer_lost_line(2, 10)))
    assert (condition(actions, "Restarting") or {})["reason"] == "WorkerFailed"
    assert status_patch(actions)["restarts"] == 1, "one failure, one restart"


def test_peer_lost_under_restart_policy_never_fails_the_job() -> None:
    job = make_job(status=running_status(), elastic={"restartPolicy": "Never"})
    patch = status_patch(run(job, survivors_of_rank_2(None), two_nodes()))
    assert patch["phase"] == "Failed"


def test_workers_get_the_heartbeat_timeout() -> None:
    job = make_job(elastic={"heartbeatTimeoutSeconds": 7})
    made = creates(run(job, [], two_nodes(), service_exists=False))
    env = {e["name"]: e["value"] for e in made[0].manifest["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_HEARTBEAT_TIMEOUT] == "7"


# --- the progress deadline -----------------------------------------------------------------------
def stalled_job(deadline: int, metrics: bool = True, restarts: int = 0) -> dict[str, Any]:
    status = {
        **running_status(since=0, metrics=metrics, restarts=restarts),
        "step": 12,
        "lastProgressTime": to_rfc3339(at(10)),
    }
    return make_job(status=status, elastic={"progressDeadlineSeconds": deadline})


def test_no_step_progress_for_the_deadline_restarts_the_gang_counted() -> None:
    same_step = TrainerProgress(step=12, checkpoints_published=True)
    assert run(stalled_job(60), gang(4), two_nodes(), now=70, progress=same_step) == []
    actions = run(stalled_job(60), gang(4), two_nodes(), now=71, progress=same_step)
    patch = status_patch(actions)
    assert (patch["generation"], patch["restarts"], patch["phase"]) == (1, 1, "Restarting")
    restarting = condition(actions, "Restarting") or {}
    assert restarting["reason"] == "ProgressDeadlineExceeded"
    assert "step 12 has not advanced for 61s (elastic.progressDeadlineSeconds=60)" in restarting["message"]
    assert {d.grace_seconds for d in deletes(actions)} == {5}, "a stuck trainer cannot checkpoint"
    assert CountRestart("ProgressDeadlineExceeded") in actions


def test_a_step_seen_in_the_same_pass_is_progress() -> None:
    moved = TrainerProgress(step=13, checkpoints_published=True)
    patch = status_patch(run(stalled_job(60), gang(4), two_nodes(), now=200, progress=moved))
    assert patch == {"step": 13, "lastProgressTime": to_rfc3339(at(200))}


def test_the_deadline_counts_from_the_generation_start_and_respects_max_restarts() -> None:
    job = stalled_job(60, restarts=3)
    job["status"]["conditions"][0]["lastTransitionTime"] = to_rfc3339(at(50))  # running since 50
    assert run(job, gang(4), two_nodes(), now=109) == []
    patch = status_patch(run(job, gang(4), two_nodes(), now=111))
    assert patch["phase"] == "Failed" and patch["restarts"] == 4
    assert (next(c for c in patch["conditions"] if c["type"] == "Failed"))["reason"] == "MaxRestartsExceeded"


def test_without_a_step_metric_the_deadline_is_not_enforced_and_a_condition_says_so() -> None:
    actions = run(stalled_job(60, metrics=False), gang(4), two_nodes(), now=1000)
    assert "generation" not in status_patch(actions)
    available = condition(actions, "MetricsAvailable") or {}
    assert (available["status"], available["reason"]) == ("False", "NoMetrics")
    assert "progressDeadlineSeconds is not enforced" in available["message"]


# --- what the trainer publishes ---------------------------------------------------------------
def plain_job(**kw: Any) -> dict[str, Any]:
    return make_job(status=running_status(since=0, metrics=False), **kw)


def test_a_rank_0_without_metrics_is_a_trainer_without_metrics_only_after_the_grace() -> None:
    settings = ReconcilerSettings(metrics_grace_seconds=30)
    assert run(plain_job(), gang(4), two_nodes(), now=29, settings=settings) == []
    actions = run(plain_job(), gang(4), two_nodes(), now=31, settings=settings)
    available = condition(actions, "MetricsAvailable") or {}
    assert (available["status"], available["reason"]) == ("False", "NoMetrics")
    assert available["message"].startswith("rank 0 served no metrics on port 9400 in 30s of running")
    # an answer later turns it around
    later = run(applied(plain_job(), actions), gang(4), two_nodes(), now=40, progress=DTJOB_TRAINER)
    assert ((condition(later, "MetricsAvailable") or {})["reason"]) == "StepAndCheckpoints"


def test_a_known_trainer_is_not_forgotten_when_one_scrape_fails() -> None:
    job = make_job(status=running_status(since=0))
    assert run(job, gang(4), two_nodes(), now=1000, progress=None) == []


def test_what_an_answering_endpoint_lacks_is_named() -> None:
    step_only = run(plain_job(), gang(4), two_nodes(), now=5, progress=TrainerProgress(step=3))
    assert (condition(step_only, "MetricsAvailable") or {})["reason"] == "StepOnly"
    nothing = run(plain_job(), gang(4), two_nodes(), now=5, progress=TrainerProgress())
    available = condition(nothing, "MetricsAvailable") or {}
    assert (available["status"], available["reason"]) == ("False", "NoStepMetric")
    assert "without dtjob_trainer_step" in available["message"]


# --- planned rescales of a trainer without dtjob metrics (#25) -------------------------------------
def test_grow_back_of_a_trainer_without_metrics_waits_for_them_then_rescales_without_a_checkpoint() -> None:
    job = make_job(status=running_status(size=2, generation=1, since=0, metrics=False))
    settings = ReconcilerSettings(metrics_grace_seconds=30)
    early = run(job, gang(2, generation=1), two_nodes(), now=20, settings=settings)
    reason, message = waiting(early) or ("", "")
    assert reason == "TrainerMetrics" and "before growing from 2 to 4 workers" in message
    assert "generation" not in status_patch(early)
    actions = run(applied(job, early), gang(2, generation=1), two_nodes(), now=31, settings=settings)
    patch = status_patch(actions)
    assert (patch["generation"], patch["replicas"]) == (2, 4), "rescaled without waiting for a checkpoint"
    assert (condition(actions, "MetricsAvailable") or {})["status"] == "False"
    assert {d.grace_seconds for d in deletes(actions)} == {None}, "planned: SIGTERM and the pod's own grace"


def test_kubectl_scale_up_of_a_plain_trainer_happens_and_says_what_it_waits_for() -> None:
    status = running_status(size=2, since=0, metrics=False)
    status["conditions"].append(
        {
            "type": "MetricsAvailable",
            "status": "False",
            "reason": "NoMetrics",
            "message": "",
            "lastTransitionTime": to_rfc3339(at(30)),
        }
    )
    job = make_job(replicas=3, max_replicas=3, status=status)
    actions = run(job, gang(2), two_nodes(), now=100)
    assert (status_patch(actions)["generation"], status_patch(actions)["replicas"]) == (1, 3)
    restarted = applied(job, actions)
    # The old workers got SIGTERM; a plain script exits 75 (or anything: it is no longer counted).
    old = [make_pod(0, phase="Failed", exit_code=75), make_pod(1, phase="Running", deleting=True)]
    stopping = run(restarted, old, two_nodes(), now=101)
    assert waiting(stopping) == (
        "OldWorkers",
        "waiting for 2 workers of generation 0 to exit before starting generation 1 "
        "(they share its pod names)",
    )
    assert creates(stopping) == [] and "restarts" not in status_patch(stopping)
    started = run(applied(restarted, stopping), [], two_nodes(), now=110)
    assert len(creates(started)) == 3
    assert waiting(started) == ("Workers", "waiting for 3 of 3 workers of generation 1 to run")


def test_a_dtjob_trainer_still_waits_for_its_first_checkpoint() -> None:
    job = make_job(status=running_status(size=2, generation=1, since=60))
    reason, _ = waiting(run(job, gang(2, generation=1), two_nodes(), now=100)) or ("", "")
    assert reason == "Checkpoint"


# --- what the operator waits for ------------------------------------------------------------------
def test_waiting_turns_false_once_the_gang_runs() -> None:
    status = {**running_status(generation=1), "phase": "Restarting"}
    status["conditions"].append(
        {
            "type": "Waiting",
            "status": "True",
            "reason": "Workers",
            "message": "",
            "lastTransitionTime": to_rfc3339(at(90)),
        }
    )
    actions = run(make_job(status=status), gang(4, generation=1), two_nodes())
    assert status_patch(actions)["phase"] == "Running"
    cond = condition(actions, "Waiting") or {}
    assert (cond["status"], cond["reason"]) == ("False", "NotWaiting")


def test_a_suspended_job_and_an_invalid_one_say_what_they_wait_for() -> None:
    suspended = run(make_job(status=running_status(), runPolicy={"suspend": True}), gang(4), two_nodes())
    assert waiting(suspended) == (
        "Suspended",
        "waiting for spec.runPolicy.suspend to be false; 4 workers still stopping",
    )
    invalid = run(make_job(replicas=4, max_replicas=3), [], two_nodes())
    assert waiting(invalid) == ("InvalidSpec", "waiting for the spec to be fixed (see condition Valid)")


def test_checkpoint_writes_the_volume_refuses_show_on_the_job_until_one_is_written() -> None:
    job = make_job(status=running_status())
    refused = TrainerProgress(
        step=12,
        checkpoint_step=10,
        checkpoint_time=at(90).timestamp(),
        checkpoints_published=True,
        checkpoint_failures=2,
    )
    actions = run(job, gang(4), two_nodes(), progress=refused)
    failing = condition(actions, "CheckpointWriteFailing")
    assert failing is not None and failing["status"] == "True" and failing["reason"] == "VolumeRefused"
    assert "2 checkpoint writes in a row refused" in failing["message"]
    assert "resume from step 10" in failing["message"]
    assert [(e.type, e.reason) for e in events(actions)] == [("Warning", "CheckpointWriteFailed")]
    assert run(applied(job, actions), gang(4), two_nodes(), progress=refused) == [], "said once"
    written = TrainerProgress(
        step=14,
        checkpoint_step=14,
        checkpoint_time=at(99).timestamp(),
        checkpoints_published=True,
        checkpoint_failures=0,
    )
    later = run(applied(job, actions), gang(4), two_nodes(), progress=written)
    recovered = condition(later, "CheckpointWriteFailing")
    assert recovered is not None and recovered["status"] == "False"
    assert "newest: step 14" in recovered["message"]
    assert [e.reason for e in events(later)] == ["CheckpointWriteRecovered"]
    quiet = run(job, gang(4), two_nodes(), progress=written)
    assert condition(quiet, "CheckpointWriteFailing") is None, "no condition for a job that never failed one"
    # the gang finished before a scrape saw the next checkpoint: its last one was written
    finished = run(applied(job, actions), gang(4, phase="Succeeded", exit_code=0), two_nodes())
    cleared = condition(finished, "CheckpointWriteFailing")
    assert status_patch(finished)["phase"] == "Succeeded"
    assert cleared is not None and cleared["status"] == "False"


# --- restarts in place -----------------------------------------------------------------------------
def in_place(restarts: int, cause: str = "rank 1 (pod 1) exited 137 (SIGKILL)") -> TrainerProgress:
    return TrainerProgress(step=12, in_place_restarts=restarts, restart_cause=cause)


def test_restarts_in_place_from_rank_0_are_counted_once_with_an_event() -> None:
    job = make_job(status={**running_status(restarts=1), "inPlaceRestarts": 1})
    actions = run(job, gang(4), two_nodes(), progress=in_place(3))
    patch = status_patch(actions)
    assert (patch["restarts"], patch["inPlaceRestarts"]) == (3, 3)
    assert "generation" not in patch, "no new pods"
    assert [(e.type, e.reason) for e in events(actions)] == [("Warning", "RestartedInPlace")]
    assert events(actions)[0].message == (
        "generation 0: the gang restarted in place (3 in this generation, 3 restarts in all): "
        "rank 1 (pod 1) exited 137 (SIGKILL)"
    )
    assert actions.count(CountRestart("InPlace")) == 2
    again = run(applied(job, actions), gang(4), two_nodes(), progress=in_place(3))
    assert "restarts" not in status_patch(again) and not events(again), "counted once"


def test_a_failed_pods_agent_line_counts_the_restarts_in_place_metrics_did_not_show() -> None:
    job = make_job(status={**running_status(restarts=1), "inPlaceRestarts": 1}, elastic={"maxRestarts": 3})
    pods = gang(4)
    pods[1] = make_pod(1, node="n1", phase="Failed", exit_code=137)
    log = {"gpt-worker-1": "dtjob-launcher[pod 1]: ...\n" + contract.in_place_line(3) + "\n"}
    actions = run(job, pods, two_nodes(), worker_logs=log)
    patch = status_patch(actions)
    # 3 in place (2 of them new) and the failure itself: 4 > maxRestarts 3
    assert (patch["restarts"], patch["phase"]) == (4, "Failed")
    assert (condition(actions, "Failed") or {})["reason"] == "MaxRestartsExceeded"


def test_a_new_generation_counts_its_restarts_in_place_from_0() -> None:
    job = make_job(status={**running_status(restarts=2), "inPlaceRestarts": 2})
    pods = gang(4)
    pods[3] = make_pod(3, node="n2", phase="Failed", exit_code=1)
    patch = status_patch(run(job, pods, two_nodes()))
    assert (patch["generation"], patch["restarts"], patch["inPlaceRestarts"]) == (1, 3, 0)
    created = creates(run(applied(job, run(job, pods, two_nodes())), [], two_nodes()))
    env = {e["name"]: e["value"] for e in created[0].manifest["spec"]["containers"][0]["env"]}
    assert env[contract.ENV_RESTARTS_LEFT] == "0", "maxRestarts 3 - 3 restarts"
