"""How many workers of a job fit on the cluster's Ready nodes right now.

Used to pick the world size of a new generation (shrink to what fits after a node loss) and to
notice capacity returning (grow back). Counts every resource the worker requests
(`nvidia.com/gpu`, `cpu`, `memory`, ...) plus one pod slot, against each node's allocatable minus
what other pods bound to that node request. The job's own pods are not subtracted: they are the
ones the new generation replaces.
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
        if not node_is_usable(node):
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
