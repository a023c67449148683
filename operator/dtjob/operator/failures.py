"""Failures of the current generation's workers, found in their pods, their nodes and their logs
(and a gang whose step stalls), and the one message and moment a restart reports them with
(rule 6 of the reconciler)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from dtjob import contract
from dtjob.operator import manifests
from dtjob.operator.conditions import condition_time
from dtjob.operator.jobview import EXIT_CHECKPOINTED
from dtjob.operator.nodes import node_lost
from dtjob.operator.observed import Worker
from dtjob.operator.progress import METRICS_AVAILABLE, publishes_step, stalled_for
from dtjob.operator.reconcile_pass import ReconcilePass
from dtjob.operator.timefmt import from_rfc3339
from dtjob.operator.trainer_reports import running_gang

# Restart reasons that are failures (not planned rescales): time to recover is measured for these.
FAILURE_REASONS = frozenset(
    {"WorkerFailed", "WorkerDeleted", "NodeLost", "WorkerStopped", "PeerLost", "ProgressDeadlineExceeded"}
)
# Failures named one by one in a message; beyond them, the message counts the rest.
LISTED = 3
EXIT_PEER_LOST = contract.EXIT_PEER_LOST


@dataclass(frozen=True)
class WorkerFailure:
    """Why the current generation cannot go on as it is, found on one of its workers."""

    worker: Worker
    # WorkerFailed, WorkerDeleted, NodeLost, WorkerStopped, Preempted, PeerLost, ProgressDeadlineExceeded
    reason: str
    message: str
    counted: bool  # counts towards maxRestarts
    lost_rank: int | None = None  # PeerLost: the trainer rank its log names (see lost_pod_rank)


def detect(p: ReconcilePass, current: Sequence[Worker]) -> list[WorkerFailure]:
    """The failures of the current generation's workers, at most one each: a lost node, a
    preemption, an exit (75: stopped after a checkpoint; 76: a peer lost; others: failed), or a
    deletion nobody planned."""
    nodes = p.nodes
    found: list[WorkerFailure] = []
    for w in current:
        if w.phase == "Succeeded":
            continue
        if w.node_name and w.node_name not in nodes:
            found.append(WorkerFailure(w, "NodeLost", f"node {w.node_name} of {w.name} is gone", True))
        elif w.node_name and not w.terminal and node_lost(p, w):
            found.append(WorkerFailure(w, "NodeLost", f"node {w.node_name} of {w.name} is NotReady", True))
        elif w.preempted is not None and (w.deleting or w.terminal):
            # planned by the scheduler, whatever the exit code its SIGTERM ended in
            found.append(WorkerFailure(w, "Preempted", f"{w.name} was preempted: {w.preempted}", False))
        elif w.phase == "Failed" and w.exit_code == EXIT_CHECKPOINTED:
            found.append(
                WorkerFailure(w, "WorkerStopped", f"{w.name} stopped after a checkpoint (exit 75)", False)
            )
        elif w.phase == "Failed" and w.exit_code == EXIT_PEER_LOST:
            lost = contract.parse_peer_lost_line((w.message or "") + "\n" + p.obs.worker_logs.get(w.name, ""))
            found.append(
                WorkerFailure(w, "PeerLost", f"{w.name} exited {EXIT_PEER_LOST} (peer lost)", True, lost)
            )
        elif w.phase == "Failed":
            how = f"exit code {w.exit_code}" if w.exit_code is not None else (w.reason or "no exit code")
            said = contract.last_words(w.message or "") or contract.last_words(
                p.obs.worker_logs.get(w.name, "")
            )
            found.append(
                WorkerFailure(
                    w, "WorkerFailed", f"{w.name} failed ({how})" + (f": {said}" if said else ""), True
                )
            )
        elif w.deleting:
            found.append(WorkerFailure(w, "WorkerDeleted", f"{w.name} was deleted", True))
    return found


def stalled_gang(p: ReconcilePass, current: Sequence[Worker], size: int) -> WorkerFailure | None:
    """A running gang whose step has not advanced for progressDeadlineSeconds, as a failure."""
    deadline = p.job.progress_deadline_seconds
    since = running_gang(p, current, size)
    if deadline is None or since is None or not publishes_step(p.condition(METRICS_AVAILABLE)):
        return None
    stalled = stalled_for(p.now, from_rfc3339(p.status.get("lastProgressTime")), since)
    if stalled is None:
        return None
    p.wake_at(p.now + timedelta(seconds=deadline - stalled), strict=True)
    if stalled <= deadline:
        return None
    rank0 = next((w for w in current if w.rank == 0), current[0])
    message = (
        f"step {p.status.get('step', 0)} has not advanced for {stalled:.0f}s "
        f"(elastic.progressDeadlineSeconds={deadline})"
    )
    return WorkerFailure(rank0, "ProgressDeadlineExceeded", message, True)


def failed_at(p: ReconcilePass, failures: Sequence[WorkerFailure]) -> datetime | None:
    """When the first of `failures` happened, where the pods or nodes say: a container's end, a
    node's NotReady, the last step of a stalled gang (None: not known)."""
    moments: list[datetime] = []
    for f in failures:
        w = f.worker
        if f.reason == "ProgressDeadlineExceeded":
            moments.append(from_rfc3339(p.status.get("lastProgressTime")) or p.now)
        elif f.reason == "NodeLost" and w.node_name in p.nodes:
            ready = condition_time(p.nodes[str(w.node_name)].get("status") or {}, "Ready", None)
            moments += [ready] if ready is not None else []
        elif w.finished is not None:
            moments.append(w.finished)
    return min(moments, default=None)


def describe(p: ReconcilePass, failures: Sequence[WorkerFailure]) -> str:
    """One message for the failures of a pass; the survivors of a lost peer are summed up under
    the rank they name, and beyond LISTED failures the rest are counted, not listed."""
    parts = [f.message for f in failures if f.reason != "PeerLost"]
    if len(parts) > LISTED + 1:
        parts = [_some(parts, "; ")]
    lost: dict[int | None, list[str]] = {}
    for f in failures:
        if f.reason == "PeerLost":
            lost.setdefault(f.lost_rank, []).append(f.worker.name)
    timeout = p.job.heartbeat_timeout_seconds
    for rank, names in lost.items():
        who = f"{_some(names)} exited {EXIT_PEER_LOST}"
        if rank is None:
            parts.append(f"{who}: a peer stopped answering (no rank named in the log)")
        else:
            name = manifests.worker_name(p.job.name, lost_pod_rank(p, rank))
            parts.append(f"rank {rank} ({name}) lost: no heartbeat for {timeout}s ({who})")
    return "; ".join(parts)


def lost_pod_rank(p: ReconcilePass, trainer_rank: int) -> int:
    """The pod of a trainer rank a survivor named: a pod of rank r runs the trainer ranks
    r * nprocPerWorker to r * nprocPerWorker + nprocPerWorker - 1 (manifests, dtjob.launcher)."""
    return trainer_rank // p.job.nproc_per_worker


def lost_pods(p: ReconcilePass, failures: Sequence[WorkerFailure], current: Sequence[Worker]) -> list[Worker]:
    """The workers whose trainer ranks the survivors among `failures` named as lost."""
    ranks = {
        lost_pod_rank(p, f.lost_rank) for f in failures if f.reason == "PeerLost" and f.lost_rank is not None
    }
    return [w for w in current if w.rank in ranks]


def _some(items: Sequence[str], joiner: str = ", ") -> str:
    """The first few items and how many more: a gang of 1,024 that fails at once is one line on
    the job (its event and condition), not 1,024."""
    if len(items) <= LISTED + 1:
        return joiner.join(items)
    return f"{joiner.join(items[:LISTED])}{joiner}and {len(items) - LISTED} more"
