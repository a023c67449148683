"""What rank 0 reports, onto the job's status: its step and last checkpoint, the checkpoint writes
its volume refused (condition CheckpointWriteFailing), its gang's restarts in place, a recovery
that fell back from memory to the durable checkpoint (event RecoveredFromCheckpoint), and whether
it publishes metrics at all (condition MetricsAvailable, see dtjob.operator.progress)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from dtjob.operator import accounting, recoveries
from dtjob.operator.observed import Worker
from dtjob.operator.progress import METRICS_AVAILABLE, metrics_availability
from dtjob.operator.reconcile_pass import RUNNING, ReconcilePass
from dtjob.operator.restarts import count_in_place, recovered
from dtjob.operator.timefmt import from_rfc3339, to_rfc3339

CHECKPOINT_WRITE_FAILING = "CheckpointWriteFailing"


def read_metrics(p: ReconcilePass) -> None:
    """Step and last checkpoint from rank 0. Steps count from 1, so a gauge at 0 is a trainer
    still starting (before it loaded its checkpoint): it says nothing, and must not move the
    job's step back to 0 in between."""
    progress = p.obs.progress
    if progress is None:
        return
    if progress.step:
        if progress.step != p.status.get("step"):
            p.status["lastProgressTime"] = to_rfc3339(p.now)
        p.status["step"] = progress.step
    if progress.checkpoint_step and progress.checkpoint_time:
        moment = datetime.fromtimestamp(progress.checkpoint_time, UTC)
        p.status["lastCheckpoint"] = {"step": progress.checkpoint_step, "time": to_rfc3339(moment)}
    if progress.checkpoint_failures is not None:
        _track_checkpoint_writes(p, progress.checkpoint_failures)
    if progress.in_place_restarts is not None:
        failed_at = None
        if progress.restart_failed_at is not None:  # never after now: a pod's clock may run ahead
            failed_at = min(datetime.fromtimestamp(progress.restart_failed_at, UTC), p.now)
        count_in_place(p, progress.in_place_restarts, progress.restart_cause, failed_at=failed_at)
    closed = accounting.sample(p.status, progress, p.now)
    recovered(p, closed)
    if closed is not None:  # once per recovery: when its new gang is seen stepping
        fallback = recoveries.from_checkpoint(progress.resume_lost_step, progress.resumed_step)
        if fallback is not None:
            p.event(recoveries.RECOVERED_FROM_CHECKPOINT, fallback, warning=True)


def _track_checkpoint_writes(p: ReconcilePass, failures: int) -> None:
    """Condition CheckpointWriteFailing: rank 0's periodic checkpoints refused by the volume in a
    row (the trainer trains on without them, so nothing else on the job would show it)."""
    failing = (p.condition(CHECKPOINT_WRITE_FAILING) or {}).get("status") == "True"
    if failures > 0:
        newest = (p.status.get("lastCheckpoint") or {}).get("step")
        resume = f"step {newest}" if newest else "the start"
        message = (
            f"rank 0 reports {failures} checkpoint writes in a row refused by the checkpoint volume "
            f"(full, read-only or failing; the workers' logs name the error): the gang trains on, "
            f"and a restart now would resume from {resume}"
        )
        if not failing:
            p.event("CheckpointWriteFailed", message, warning=True)
        p.set_condition(CHECKPOINT_WRITE_FAILING, True, "VolumeRefused", message)
    elif failing:
        newest = (p.status.get("lastCheckpoint") or {}).get("step")
        message = f"rank 0 reports no checkpoint write refused since its last one (newest: step {newest})"
        p.event("CheckpointWriteRecovered", message)
        p.set_condition(CHECKPOINT_WRITE_FAILING, False, "NoRefusedWrites", message)


def track_metrics(p: ReconcilePass, current: Sequence[Worker], size: int) -> None:
    """Condition MetricsAvailable: what a running rank 0 publishes (see dtjob.operator.progress)."""
    since = running_gang(p, current, size)
    if since is None:
        return
    known = p.condition(METRICS_AVAILABLE)
    running = (p.now - since).total_seconds()
    if (known or {}).get("status") != "True":  # no answer yet: NoMetrics once the grace ends
        p.wake_at(since + timedelta(seconds=p.settings.metrics_grace_seconds))
    seen = metrics_availability(
        p.obs.progress, known, running, p.settings.metrics_grace_seconds, p.job.metrics_port
    )
    if seen is not None:
        p.set_condition(METRICS_AVAILABLE, seen.value, seen.reason, seen.message)


def running_gang(p: ReconcilePass, current: Sequence[Worker], size: int) -> datetime | None:
    """Since when the current generation runs in full (phase Running); None when it does not."""
    running = [w for w in current if w.phase == "Running" and not w.deleting]
    if p.status.get("phase") != RUNNING or size == 0 or len(running) != size:
        return None
    return from_rfc3339((p.condition(RUNNING) or {}).get("lastTransitionTime"))
