"""The gang's size: what fits on the Ready nodes (the silent ones left out), a new generation's
size, shrinking a gang whose workers stay unschedulable (rule 7 of the reconciler), and rescaling
a healthy gang to the desired size, up only after a checkpoint (rule 8)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from dtjob.operator.capacity import workers_that_fit
from dtjob.operator.nodes import delete_all
from dtjob.operator.observed import Worker
from dtjob.operator.progress import METRICS_AVAILABLE, publishes_checkpoints
from dtjob.operator.reconcile_pass import RUNNING, ReconcilePass
from dtjob.operator.restarts import new_generation
from dtjob.operator.timefmt import from_rfc3339


def capacity(p: ReconcilePass) -> int:
    """How many of the job's workers fit on the nodes, the silent ones left out."""
    nodes = [n for n in p.obs.nodes if (n.get("metadata") or {}).get("name") not in p.silent]
    return workers_that_fit(p.job.name, p.job.template, nodes, p.obs.node_pods)


def target_size(p: ReconcilePass) -> int:
    """The world size of a new generation: desired if it fits, else what fits, never below min."""
    fits = capacity(p)
    job = p.job
    size = max(job.min_replicas, min(job.desired_replicas, fits))
    if fits < job.min_replicas:
        p.set_condition(
            "Schedulable",
            False,
            "InsufficientCapacity",
            f"only {fits} workers fit on Ready nodes, fewer than minReplicas={job.min_replicas}: "
            f"waiting for capacity at {size} workers",
        )
        p.wait("Capacity", f"waiting for capacity: {fits} workers fit, minReplicas is {job.min_replicas}")
        p.poll = True
    else:
        p.set_condition("Schedulable", True, "Fits", f"{fits} workers fit on Ready nodes")
    return size


def fit_beside_silent_nodes(p: ReconcilePass, size: int) -> int:
    """A restarted generation is sized when its restart is decided, often before the lost rank's
    node is found silent: before its pods exist, it shrinks (never below minReplicas) to what fits
    beside the silent nodes, instead of leaving a pod unschedulable for unschedulableTimeoutSeconds
    (60 s by default) first."""
    fits = capacity(p)
    target = max(p.job.min_replicas, min(size, fits))
    if target >= size:
        return size
    p.status["replicas"] = target
    p.status["worldSize"] = target * p.job.nproc_per_worker
    p.event(
        "Rescale",
        f"generation {p.status.get('generation')} starts with {target} workers, not {size}: {fits} fit "
        f"beside the silent nodes {', '.join(sorted(p.silent))}",
    )
    return target


def maybe_shrink(
    p: ReconcilePass, unscheduled: Sequence[Worker], workers: Sequence[Worker], size: int
) -> bool:
    """Rule 7: workers unschedulable past the scheduling timeout shrink the gang to what fits
    (never below minReplicas); True when a new generation was started."""
    job = p.job
    waiting_since = min((w.created for w in unscheduled if w.created), default=None)
    if waiting_since is None:
        return False
    p.wake_at(waiting_since + timedelta(seconds=job.scheduling_timeout_seconds))
    if (p.now - waiting_since).total_seconds() < job.scheduling_timeout_seconds:
        return False
    p.poll = True  # past the timeout, what fits changes with the other jobs' pods
    fits = capacity(p)
    if job.uses_podgroup and fits >= size:
        # Volcano places the gang whole or not at all, and the nodes have room for it: what
        # holds it is its queue (capability, other jobs) or priority, not capacity, and a
        # smaller gang would wait in the same queue.
        return False
    scheduled = size - len(unscheduled)
    candidate = fits if fits < size else scheduled
    target = max(job.min_replicas, min(candidate, size - 1))
    if target >= size:
        p.set_condition(
            "Schedulable",
            False,
            "InsufficientCapacity",
            f"{len(unscheduled)} of {size} workers unschedulable for more than "
            f"{job.scheduling_timeout_seconds:g}s and the job is at minReplicas={job.min_replicas}: "
            "waiting for capacity",
        )
        p.wait("Capacity", f"waiting for capacity: {len(unscheduled)} of {size} workers unschedulable")
        return False
    p.set_condition(
        "Schedulable", False, "Unschedulable", f"{len(unscheduled)} of {size} workers did not fit"
    )
    new_generation(
        p,
        target,
        "Unschedulable",
        f"{len(unscheduled)} of {size} workers unschedulable for more than "
        f"{job.scheduling_timeout_seconds:g}s; shrinking to what fits",
        counted=False,
    )
    # A gang with unscheduled members never got past its rendezvous: nothing to checkpoint.
    delete_all(p, workers, p.settings.unplanned_stop_grace_seconds)
    return True


def maybe_rescale(p: ReconcilePass, workers: Sequence[Worker], size: int) -> bool:
    """Rule 8: a healthy gang whose size is not the desired one rescales, down at once, up once
    the capacity is there and after a checkpoint; True when a new generation was started."""
    job = p.job
    desired = job.desired_replicas
    if size > desired:
        new_generation(p, desired, "ScaleDown", f"spec.replicas is {job.replicas}", counted=False)
        delete_all(p, workers)
        return True
    if size == desired:
        return False
    fits = capacity(p)
    target = min(desired, fits)
    if target <= size:
        p.wait("Capacity", f"waiting for capacity to grow from {size} to {desired} workers: {fits} fit")
        p.poll = True
        return False
    running_since = from_rfc3339((p.condition(RUNNING) or {}).get("lastTransitionTime"))
    hold = p.settings.grow_hold_seconds
    if running_since is not None:
        p.wake_at(running_since + timedelta(seconds=hold))
    if running_since is not None and (p.now - running_since).total_seconds() < hold:
        # No running seconds in the message: it would change (a status write) on every pass.
        p.wait(
            "RescaleHold",
            f"generation {p.status.get('generation')} runs at {size} workers; it grows to {target} "
            f"once it has run {hold:g}s",
        )
        return False
    if not _checkpointed_since(p, running_since, f"growing from {size} to {target} workers"):
        return False
    new_generation(p, target, "ScaleUp", f"capacity for {fits} workers, desired {desired}", counted=False)
    p.set_condition("Schedulable", True, "Fits", f"{fits} workers fit on Ready nodes")
    delete_all(p, workers)
    return True


def _checkpointed_since(p: ReconcilePass, since: datetime | None, doing: str) -> bool:
    """Whether the current generation's progress is safe from a planned rescale: a checkpoint
    written since it started running, or nothing to wait for (no checkpoint storage, or a trainer
    that does not report its checkpoints: it gets SIGTERM and its grace period, as any trainer).
    Says what it waits for otherwise."""
    if p.job.checkpoint_volume is None or since is None:
        return True
    written = from_rfc3339((p.status.get("lastCheckpoint") or {}).get("time"))
    if written is not None and written >= since:
        return True
    reports = publishes_checkpoints(
        p.condition(METRICS_AVAILABLE), p.status.get("lastCheckpoint") is not None
    )
    if reports is False:
        return True
    generation = p.status.get("generation")
    if reports is None:
        grace = p.settings.metrics_grace_seconds
        p.wait(
            "TrainerMetrics",
            f"waiting up to {grace:g}s of running for rank 0's metrics, to know whether the trainer "
            f"reports checkpoints, before {doing}",
        )
    else:
        p.wait(
            "Checkpoint",
            f"waiting for generation {generation}'s first checkpoint before {doing} (a rescale before "
            "it would lose the steps since the generation started)",
        )
    return False
