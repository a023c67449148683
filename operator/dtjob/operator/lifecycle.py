"""A job's life around its gangs: its start (generation 0, or Suspended), the RestartInPlace
condition, activeDeadlineSeconds, success and failure, the clean-up of a finished job
(cleanPodPolicy, ttlSecondsAfterFinished), and suspend (rules 1-4 of the reconciler)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from dtjob.operator import accounting, in_place
from dtjob.operator.actions import DeleteJob, DeletePod
from dtjob.operator.nodes import delete
from dtjob.operator.observed import Worker
from dtjob.operator.reconcile_pass import FAILED, PENDING, SUCCEEDED, SUSPENDED, ReconcilePass
from dtjob.operator.restarts import recovered
from dtjob.operator.timefmt import from_rfc3339, to_rfc3339
from dtjob.operator.trainer_reports import CHECKPOINT_WRITE_FAILING


def start(p: ReconcilePass) -> None:
    """Rule 2: a new job starts generation 0 at the desired world size, or Suspended."""
    p.status.update(generation=0, restarts=0, startTime=to_rfc3339(p.now))
    say_in_place(p)
    accounting.start(p.status, p.now)
    if p.job.suspend:
        p.status["replicas"] = 0
        p.set_phase(
            SUSPENDED, "Suspended", "created suspended: no worker runs until spec.runPolicy.suspend is false"
        )
        return
    size = p.job.desired_replicas
    p.status["replicas"] = size
    p.status["worldSize"] = size * p.job.nproc_per_worker
    p.set_phase(PENDING, "Created", f"generation 0: creating {size} workers")  # its Event: Created
    p.set_condition("Created", True, "Created", f"generation 0: creating {size} workers")


def say_in_place(p: ReconcilePass) -> None:
    """Condition RestartInPlace: on or off, and why (dtjob.operator.in_place), so that a job never
    goes without restarts in place unsaid."""
    rule = p.job.restart_in_place_rule
    p.set_condition(in_place.CONDITION, rule.on, rule.reason, rule.message)


def deadline_passed(p: ReconcilePass) -> bool:
    """Rule 3: whether the job ran longer than activeDeadlineSeconds since its startTime."""
    deadline = p.job.active_deadline_seconds
    started = from_rfc3339(p.status.get("startTime"))
    if deadline is None or started is None:
        return False
    p.wake_at(started + timedelta(seconds=deadline), strict=True)
    return (p.now - started).total_seconds() > deadline


def fail(p: ReconcilePass, workers: Sequence[Worker], reason: str, message: str) -> None:
    """The job failed: its phase, its accounts closed, its pods cleaned up."""
    p.status["completionTime"] = to_rfc3339(p.now)
    recovered(p, accounting.finished(p.status, p.now, succeeded=False))
    p.set_phase(FAILED, reason, message, warning=True)
    clean_up_finished(p, workers)


def succeed(p: ReconcilePass, workers: Sequence[Worker]) -> None:
    """The job succeeded (every worker exited 0): its phase, step and accounts, its pods
    cleaned up."""
    p.status["completionTime"] = to_rfc3339(p.now)
    checkpoint_step = (p.status.get("lastCheckpoint") or {}).get("step")
    if checkpoint_step is not None:
        p.status["step"] = max(int(p.status.get("step") or 0), int(checkpoint_step))
    recovered(p, accounting.finished(p.status, p.now, succeeded=True))
    if (p.condition(CHECKPOINT_WRITE_FAILING) or {}).get("status") == "True":
        # the last step's checkpoint is never skipped: a trainer that exits 0 wrote it
        message = f"the last step's checkpoint was written (step {p.status.get('step')})"
        p.set_condition(CHECKPOINT_WRITE_FAILING, False, "NoRefusedWrites", message)
    p.set_phase(
        SUCCEEDED,
        "Succeeded",
        f"all {len(workers)} workers of generation {p.status.get('generation')} exited 0",
    )
    clean_up_finished(p, workers)


def clean_up_finished(p: ReconcilePass, workers: Sequence[Worker]) -> None:
    """Rule 1: a finished job's pods go as cleanPodPolicy says, the job itself
    ttlSecondsAfterFinished after its completion."""
    policy = p.job.clean_pod_policy
    for w in workers:
        if w.deleting:
            continue
        if policy == "All" or (policy == "Running" and not w.terminal):
            p.actions.append(DeletePod(w.name, f"job finished, cleanPodPolicy={policy}"))
    ttl = p.job.ttl_seconds_after_finished
    done = from_rfc3339(p.status.get("completionTime"))
    if ttl is None or done is None:
        return
    p.wake_at(done + timedelta(seconds=ttl))
    if (p.now - done).total_seconds() >= ttl:
        p.actions.append(DeleteJob(f"finished {ttl}s ago (ttlSecondsAfterFinished)"))


def suspend(p: ReconcilePass, workers: Sequence[Worker]) -> None:
    """Rule 4: a suspended job's pods are deleted gracefully (the trainer checkpoints, exit 75)."""
    if p.status.get("phase") != SUSPENDED:
        p.set_phase(SUSPENDED, "Suspended", "spec.runPolicy.suspend is true: workers checkpoint and stop")
    for w in workers:
        delete(p, w, "job suspended")
    stopping = f"; {len(workers)} workers still stopping" if workers else ""
    p.wait("Suspended", f"waiting for spec.runPolicy.suspend to be false{stopping}")
