"""Workers and their nodes: a node lost (gone, or NotReady), a kubelet gone silent (a Ready node
that leaves a pod's deletion unfinished), the nodes new workers avoid for it (status.silentNodes,
which also holds the nodes suspected at once, dtjob.operator.suspects), and deleting workers so
that neither keeps a pod's name taken (rule 5 of the reconciler)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime, timedelta

from dtjob.operator.actions import DeletePod
from dtjob.operator.capacity import node_is_ready
from dtjob.operator.conditions import condition_time
from dtjob.operator.observed import Worker
from dtjob.operator.reconcile_pass import ReconcilePass
from dtjob.operator.timefmt import from_rfc3339, to_rfc3339

# A kubelet kills a deleted pod's containers at the end of its grace period and the pod is gone
# within about a second (the nodelet: 0.05 s; a loaded kubelet: 1-2 s; KWOK deleting 1,024 pods at
# once: up to 12 s); 5 s later it is taken for silent. A rank its peers declared lost (deleted with
# LOST_RANK_GRACE_SECONDS) is suspect already, and waits 2 s: 3 s less of every node loss before
# the next gang starts (at 2 s for every pod, KWOK's 1,024-pod deletions were taken for 128 silent
# nodes). The node is avoided by new workers for 120 s (a silent node turns NotReady within the
# node controller's grace, 20 s here and 40-50 s on a default cluster), or until it turns NotReady,
# is Ready again after a transition, or renews its Lease: a live kubelet taken for silent renews
# it within 10 s (the nodelet: 4 s), so a false alarm costs its node seconds, not minutes.
# None is a multiple of the job's heartbeat timeout T: they time the kubelet and the node
# controller, which no job setting changes (dtjob/liveness_table.py, docs/design.md).
SILENT_KUBELET_SECONDS = 5
SILENT_LOST_RANK_SECONDS = 2
SILENT_NODE_AVOID_SECONDS = 120

# The grace of a rank its peers declared lost (no heartbeat: hung, cut off, or on a silent node, it
# cannot act on SIGTERM) where its node cannot be avoided (dtjob.operator.suspects: the nodes beside
# it have no room for the next gang; elsewhere it is forced at once and its node avoided). 1 s: a
# live kubelet kills it and confirms within about a second, so the next generation, whose pod takes
# its name, starts 4 s sooner than after the 5 s unplanned grace. Not 0 there: a force deletion
# frees the name at once, and the scheduler could place the next gang on a silent node that still
# looks Ready (a second restart at its NotReady, 20-50 s later).
LOST_RANK_GRACE_SECONDS = 1


def node_lost(p: ReconcilePass, w: Worker) -> bool:
    """Whether w is bound to a node that is gone or NotReady."""
    if not w.node_name:
        return False
    node = p.nodes.get(w.node_name)
    if node is None:
        return True
    if node_is_ready(node):
        return False
    # A pod bound after the NotReady transition seen here: the node came back and this view
    # lags, until node_view_lag_seconds after the binding; later, the node is lost (a scheduler
    # binds in the moment between the transition and the node's taint; seen in chaos runs).
    since = condition_time(node.get("status") or {}, "Ready", value=None)
    if w.scheduled is None or since is None or w.scheduled <= since:
        return True
    p.wake_at(w.scheduled + timedelta(seconds=p.settings.node_view_lag_seconds))
    return (p.now - w.scheduled).total_seconds() >= p.settings.node_view_lag_seconds


def delete(p: ReconcilePass, w: Worker, reason: str, grace_seconds: int | None = None) -> None:
    """Delete gracefully (SIGTERM: the trainer checkpoints; grace_seconds None is the pod's
    own grace period), or force when nobody is left to run a graceful deletion: the pod
    already ended, its node is lost (a graceful deletion on a dead node would never
    complete and keep the pod's name taken), or its node's kubelet is silent. A pod deleted
    with no grace period already is left to the API server, which removes it at once (deleting
    it again each pass until its watch event comes is a 404 each: 105 when 50 of 500 jobs
    restarted)."""
    if w.deleting and w.deletion_grace == 0:
        return
    if w.terminal or node_lost(p, w):
        p.actions.append(DeletePod(w.name, reason, grace_seconds=0))
    elif w.deleting and kubelet_silent(p, w):
        p.actions.append(DeletePod(w.name, f"{reason}; its kubelet is silent", grace_seconds=0))
        if w.node_name in p.silent:
            return  # its other pods: the node was found silent before
        p.event(
            "NodeSilent",
            f"node {w.node_name} left the deletion of {w.name} unfinished {_silent_after(w):g}s "
            f"past its grace period: deleted without it, and new workers avoid the node for "
            f"{SILENT_NODE_AVOID_SECONDS}s or until it turns NotReady or renews its Lease"
            + _why_not_sooner(w),
            warning=True,
        )
        entry = {"name": str(w.node_name), "since": to_rfc3339(p.now)}
        lease = p.obs.leases.get(str(w.node_name))
        if lease:
            entry["leaseRenewTime"] = lease
        p.silent[str(w.node_name)] = entry
    elif not w.deleting:
        p.actions.append(DeletePod(w.name, reason, grace_seconds=grace_seconds))


def delete_all(
    p: ReconcilePass,
    workers: Sequence[Worker],
    grace_seconds: int | None = None,
    lost: Collection[str] = (),
    suspects: Collection[str] = (),
) -> None:
    """Delete every worker; those named in `lost` with LOST_RANK_GRACE_SECONDS, or forced where
    their node is among `suspects` (dtjob.operator.suspects: the next gang avoids it), as is every
    other live worker there (a stopped node stops them all)."""
    for w in workers:
        reason = f"stopping generation {w.generation} for generation {p.status.get('generation')}"
        if w.name in lost:
            reason = f"rank {w.rank} lost by its peers (no heartbeat), {reason}"
        if w.node_name in suspects and not w.terminal:
            p.actions.append(DeletePod(w.name, f"{reason}; node {w.node_name} suspected", grace_seconds=0))
        else:
            delete(p, w, reason, LOST_RANK_GRACE_SECONDS if w.name in lost else grace_seconds)


def _why_not_sooner(w: Worker) -> str:
    """Why a rank its peers declared lost was not force-deleted and its node avoided in the pass
    that restarted the gang (dtjob.operator.suspects): only then is its deletion graceful."""
    if w.deletion_grace != LOST_RANK_GRACE_SECONDS:
        return ""
    return (
        " (not avoided when the peers lost the rank: the nodes beside it had no room for the whole "
        "next gang, so it waited for this)"
    )


def kubelet_silent(p: ReconcilePass, w: Worker) -> bool:
    """Whether w's node, Ready in this view, left its deletion unfinished SILENT_KUBELET_SECONDS
    past the grace period (a kubelet kills and removes a pod at its deadline, within about a
    second): a node gone silent that has not turned NotReady yet (20-50 s later)."""
    if w.deletion_deadline is None or not w.node_name:
        return False
    if w.node_name in p.silent:
        return True
    p.wake_at(w.deletion_deadline + timedelta(seconds=_silent_after(w)))
    return silent_deletion(w, p.now)


def _silent_after(w: Worker) -> float:
    """Seconds past its grace period after which w's unfinished deletion means a silent kubelet:
    SILENT_LOST_RANK_SECONDS for a rank its peers declared lost (the only deletions that get
    LOST_RANK_GRACE_SECONDS), else SILENT_KUBELET_SECONDS."""
    return SILENT_LOST_RANK_SECONDS if w.deletion_grace == LOST_RANK_GRACE_SECONDS else SILENT_KUBELET_SECONDS


def silent_deletion(w: Worker, now: datetime) -> bool:
    """Whether w's deletion is unfinished past its grace period by `_silent_after` (the observer
    reads the Leases of such workers' nodes for the pass that finds them silent)."""
    if w.deletion_deadline is None or not w.node_name:
        return False
    return now >= w.deletion_deadline + timedelta(seconds=_silent_after(w))


def silent_nodes(p: ReconcilePass) -> None:
    """The nodes of status.silentNodes new workers still avoid: found silent less than
    SILENT_NODE_AVOID_SECONDS ago, Ready without a transition since (a NotReady node is avoided by
    the scheduler itself, and one Ready again after it was NotReady came back: no pass may have
    run while it was NotReady, so its Ready condition's transition time tells), and with the same
    Lease renewTime as when it was found silent (another one: its kubelet is alive; the time
    itself, the node's clock, is never compared with the operator's)."""
    nodes = p.nodes
    for entry in p.status.get("silentNodes") or []:
        name = str(entry.get("name"))
        since = from_rfc3339(entry.get("since"))
        node = nodes.get(name)
        if since is None or node is None or not node_is_ready(node):
            continue
        changed = condition_time(node.get("status") or {}, "Ready", value=None)
        if changed is not None and changed > since:
            continue
        then, lease = entry.get("leaseRenewTime"), p.obs.leases.get(name)
        if then and lease and lease != then:
            continue
        until = since + timedelta(seconds=SILENT_NODE_AVOID_SECONDS)
        p.wake_at(until)
        if p.now < until:
            p.silent[name] = {k: str(v) for k, v in entry.items()}
            # A Lease renewal is announced by no watch of the operator's: look again every tick.
            p.poll = p.poll or bool(then)
