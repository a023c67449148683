"""How many workers of a job fit on the cluster's Ready nodes right now.

Used to pick the world size of a new generation (shrink to what fits after a node loss) and to
notice capacity returning (grow back). Counts every resource the worker requests
(`nvidia.com/gpu`, `cpu`, `memory`, ...) plus one pod slot, against each node's allocatable minus
what other pods bound to that node request. The job's own pods are not subtracted: they are the
ones the new generation replaces. Only nodes the scheduler would consider count: the worker's
tolerations must tolerate the node's NoSchedule and NoExecute taints, and its nodeSelector and
required node affinity must match the node (a cluster with tainted GPU nodes, or the devcluster
with simulated nodes beside real ones, would otherwise be counted as room it is not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from dtjob.operator.jobview import LABEL_JOB
from dtjob.operator.manifests import pod_requests
from dtjob.operator.quantity import parse_quantity

# A fit count standing for "no resource limits the job on this node" never occurs: every pod
# takes one of the node's `pods` slots, and nodes without a `pods` allocatable get this many.
DEFAULT_POD_SLOTS = 110


def node_is_ready(node: Mapping[str, Any]) -> bool:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def node_is_usable(node: Mapping[str, Any]) -> bool:
    """Ready and not cordoned."""
    return node_is_ready(node) and not (node.get("spec") or {}).get("unschedulable", False)


def _tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _matches(requirement: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    """One node selector requirement (In, NotIn, Exists, DoesNotExist, Gt, Lt) against labels."""
    key, op = requirement.get("key", ""), requirement.get("operator")
    wanted = [str(v) for v in requirement.get("values") or []]
    have = values.get(key)
    if op == "In":
        return have is not None and have in wanted
    if op == "NotIn":
        return have is None or have not in wanted
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    if op in {"Gt", "Lt"} and have is not None and wanted:
        try:
            return int(have) > int(wanted[0]) if op == "Gt" else int(have) < int(wanted[0])
        except ValueError:
            return False
    return False


def node_admits(template: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """Whether the scheduler would consider `node` for a pod of `template` (taints, nodeSelector,
    required node affinity), resources aside."""
    spec = template.get("spec") or {}
    tolerations = spec.get("tolerations") or []
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in {"NoSchedule", "NoExecute"} and not _tolerates(tolerations, taint):
            return False
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if affinity:
        fields = {"metadata.name": str(meta.get("name", ""))}
        terms = affinity.get("nodeSelectorTerms") or []
        # Terms are ORed, the requirements inside one term ANDed; an empty term matches nothing.
        if not any(
            (term.get("matchExpressions") or term.get("matchFields"))
            and all(_matches(r, labels) for r in term.get("matchExpressions") or [])
            and all(_matches(r, fields) for r in term.get("matchFields") or [])
            for term in terms
        ):
            return False
    return True


def _is_active(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in {"Succeeded", "Failed"}


def workers_that_fit(
    job_name: str,
    template: Mapping[str, Any],
    nodes: Sequence[Mapping[str, Any]],
    node_pods: Sequence[Mapping[str, Any]],
) -> int:
    """The number of worker pods of `template` that the usable nodes can take."""
    per_pod = {r: q for r, q in pod_requests(template).items() if q > 0}
    per_pod["pods"] = Decimal(1)
    used: dict[str, dict[str, Decimal]] = {}
    for pod in node_pods:
        node_name = (pod.get("spec") or {}).get("nodeName")
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if not node_name or labels.get(LABEL_JOB) == job_name or not _is_active(pod):
            continue
        node_used = used.setdefault(node_name, {})
        requests = pod_requests({"spec": pod.get("spec") or {}})
        requests["pods"] = Decimal(1)
        for resource, quantity in requests.items():
            node_used[resource] = node_used.get(resource, Decimal(0)) + quantity

    total = 0
    for node in nodes:
        if not node_is_usable(node) or not node_admits(template, node):
            continue
        name = (node.get("metadata") or {}).get("name", "")
        status = node.get("status") or {}
        allocatable = status.get("allocatable") or status.get("capacity") or {}
        fits: list[int] = []
        for resource, need in per_pod.items():
            if resource in allocatable:
                have = parse_quantity(allocatable[resource])
            elif resource == "pods":
                have = Decimal(DEFAULT_POD_SLOTS)
            else:
                have = Decimal(0)  # a node without the resource (no GPU) takes no such worker
            free = have - used.get(name, {}).get(resource, Decimal(0))
            fits.append(max(0, int(free // need)))
        total += min(fits)
    return total
