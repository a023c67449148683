"""A rank its peers declared lost (no heartbeat: hung, cut off, or on a node that stopped), and its
node suspected at once (rule 6 of the reconciler): the rank's pod is force-deleted in the pass
that restarts the gang, which frees its name for the next gang at once, and new workers avoid the
node through status.silentNodes, exactly as a node found silent later (nodes.silent_nodes).

Before this, the lost rank's pod was deleted with LOST_RANK_GRACE_SECONDS and forced only once its
node was found silent, 1 + 2 s later, and the next gang was created only then: 3 s of every node
stop. The next gang may not land on a node that stopped but still looks Ready (20-50 s until
NotReady), so the force goes together with the avoidance, and both only where the gang loses no
worker by it: where the nodes beside the suspects hold fewer workers than the new generation would
have without avoiding them, the old path stays (a live kubelet kills the pod within a second; a
silent one is found out 3 s later, and the NodeSilent event says why it was not avoided at once).

A false suspicion (a trainer SIGSTOPped on a healthy node, a pod's network cut) is cheap: the
node's kubelet kills the force-deleted pod, and the node is trusted again at the next Lease
renewal (a kubelet renews every 10 s, the nodelet every 4 s; the observer reads the Lease in the
pass that suspects the node), or when it turns NotReady, or after SILENT_NODE_AVOID_SECONDS."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from dtjob.operator.capacity import workers_that_fit
from dtjob.operator.nodes import SILENT_NODE_AVOID_SECONDS, node_lost
from dtjob.operator.observed import Worker
from dtjob.operator.reconcile_pass import ReconcilePass
from dtjob.operator.timefmt import to_rfc3339

REASON = "NodeSuspect"


def suspect_nodes(p: ReconcilePass, lost: Sequence[Worker]) -> set[str]:
    """The nodes of the `lost` ranks (those its peers named) whose pods are to be force-deleted
    now: added to the nodes new workers avoid (p.silent), with a Warning event each, when the
    new gang still fits beside them; empty where it would not (the old path: a short grace, then
    silent_nodes). A node already avoided is returned as it is."""
    candidates = {
        str(w.node_name): w
        for w in lost
        if w.node_name
        and not w.terminal
        and not (w.deleting and w.deletion_grace == 0)
        and not node_lost(p, w)
    }
    new = {name: w for name, w in candidates.items() if name not in p.silent}
    if new and not _room_beside(p, new.keys()):
        return set()
    for name, w in sorted(new.items()):
        entry = {"name": name, "since": to_rfc3339(p.now)}
        lease = p.obs.leases.get(name)
        if lease:
            entry["leaseRenewTime"] = lease
            p.poll = True  # a renewal is announced by no watch of the operator's (as in silent_nodes)
        p.silent[name] = entry
        p.event(
            REASON,
            f"rank {w.rank} ({w.name}) lost by its peers (no heartbeat): deleted without a grace "
            f"period, and new workers avoid node {name} until it renews its Lease, turns NotReady, "
            f"or for {SILENT_NODE_AVOID_SECONDS}s",
            warning=True,
        )
    return set(candidates)


def _room_beside(p: ReconcilePass, suspects: Collection[str]) -> bool:
    """Whether as many workers fit beside the suspects (and the nodes already avoided) as the
    next generation would get without avoiding them (the job's desired size, or what fits)."""
    template, pods = p.job.template, p.obs.node_pods

    def fit(avoided: Collection[str]) -> int:
        nodes = [n for n in p.obs.nodes if (n.get("metadata") or {}).get("name") not in avoided]
        return workers_that_fit(p.job.name, template, nodes, pods)

    without = fit(p.silent.keys())
    return fit({*p.silent, *suspects}) >= min(p.job.desired_replicas, without)
