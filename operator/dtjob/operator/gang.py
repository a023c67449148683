"""Volcano's side of a gang, as pure functions of observed objects: whether the job's PodGroup
needs its spec updated, what the scheduler says about it, and whether a worker was preempted.

The scheduler (vc-scheduler) writes the PodGroup's status: `phase` (Pending: not admitted yet;
Inqueue: admitted, waiting for every member to fit; Running: at least minMember members bound;
Unknown: some run but the rest no longer fit; Completed) and conditions such as
`Unschedulable: 3/4 tasks in gang unschedulable: ...`. The operator copies that view into the
job's `GangScheduled` condition, so `kubectl describe dtj` says why no worker runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from dtjob.operator.quantity import format_quantity, parse_quantity

CONDITION = "GangScheduled"
# The PodGroup phase in which the gang is placed. Completed is not: vc-scheduler reports it once
# every member has ended, failed ones too, which is also a gang between two generations.
SCHEDULED_PHASES = {"Running"}
# The PodGroup condition in which vc-scheduler's gang plugin says why a gang does not fit.
UNSCHEDULABLE = "Unschedulable"
# The PodGroup spec fields the operator owns; an observed value that differs is rewritten.
OWNED_FIELDS = ("minMember", "minResources", "queue", "priorityClassName")
# A pod the scheduler preempted carries this condition (Volcano's evictor and kube-scheduler both
# write it) before it is deleted.
DISRUPTION_TARGET = "DisruptionTarget"
PREEMPTION_REASON = "PreemptionByScheduler"


def _quantities(resources: Mapping[str, Any] | None) -> dict[str, Decimal]:
    """minResources with parsed quantities ("1500m" and "1.5" are the same cpu)."""
    return {k: parse_quantity(v) for k, v in (resources or {}).items()}


def spec_differs(have: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The owned spec fields of the observed PodGroup `have` that differ from the manifest `wanted`."""
    have_spec = have.get("spec") or {}
    wanted_spec = wanted.get("spec") or {}
    differs = []
    for key in OWNED_FIELDS:
        a, b = have_spec.get(key), wanted_spec.get(key)
        if key == "minResources":
            a, b = _quantities(a), _quantities(b)
        if (a or None) != (b or None):
            differs.append(key)
    return differs


def spec_patch(wanted: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch setting every owned field to the manifest's value; an unset one is
    removed (null), so a job that drops its queue goes back to Volcano's default queue."""
    spec = wanted.get("spec") or {}
    return {"spec": {key: spec.get(key) for key in OWNED_FIELDS}}


def last_condition(podgroup: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The PodGroup's most recent condition (by lastTransitionTime; the later one on a tie)."""
    conditions = list((podgroup.get("status") or {}).get("conditions") or [])
    if not conditions:
        return None
    indexed = list(enumerate(conditions))
    return max(indexed, key=lambda ic: (str(ic[1].get("lastTransitionTime") or ""), ic[0]))[1]


@dataclass(frozen=True)
class GangView:
    """The job's GangScheduled condition: the PodGroup's phase, and while the gang waits the
    scheduler's reason (`why`, its last Unschedulable condition), if it gave one."""

    scheduled: bool
    phase: str
    message: str
    why: str | None


def view(
    podgroup: Mapping[str, Any],
    queue: Mapping[str, Any] | None = None,
    queue_missing: bool = False,
    placing: bool = False,
) -> GangView:
    """What the job says about its gang. `queue` is the PodGroup's Volcano Queue as observed (None
    when it could not be read; queue_missing when it does not exist). `placing`: some members are
    bound already, so the queue's allocation counts them and says nothing about room for them."""
    name = (podgroup.get("metadata") or {}).get("name", "")
    status = podgroup.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    min_member = (podgroup.get("spec") or {}).get("minMember")
    running = int(status.get("running") or 0)
    message = f"Volcano PodGroup {name} is {phase} (minMember {min_member}, {running} running)"
    scheduled = phase in SCHEDULED_PHASES
    if scheduled:
        return GangView(True, phase, message, None)
    reasons = [None if placing else queue_reason(podgroup, queue, queue_missing)]
    last = last_condition(podgroup) or {}
    if last.get("type") == UNSCHEDULABLE and last.get("status") == "True":
        reasons.append(str(last.get("message") or last.get("reason") or "").strip() or None)
    why = "; ".join(r for r in reasons if r) or None
    return GangView(False, phase, f"{message}: {why}" if why else message, why)


def queue_reason(
    podgroup: Mapping[str, Any], queue: Mapping[str, Any] | None, queue_missing: bool
) -> str | None:
    """Why the PodGroup's queue holds it, if it does: the queue is missing, not Open, or its
    capability has no room for the gang's minResources. vc-scheduler says none of this on any
    object (only in its log), and without Volcano's admission webhook a PodGroup naming a queue
    that does not exist is accepted and waits forever."""
    name = (podgroup.get("spec") or {}).get("queue") or "default"
    if queue_missing:
        return f"Volcano queue {name} does not exist"
    if queue is None:
        return None
    state = (queue.get("status") or {}).get("state")
    if state and state != "Open":
        return f"Volcano queue {name} is {state}"
    capability = _quantities((queue.get("spec") or {}).get("capability"))
    allocated = _quantities((queue.get("status") or {}).get("allocated"))
    needed = _quantities((podgroup.get("spec") or {}).get("minResources"))
    short = [
        f"{r} {format_quantity(allocated.get(r, Decimal(0)))} of {format_quantity(cap)} in use, "
        f"the gang needs {format_quantity(needed[r])}"
        for r, cap in sorted(capability.items())
        if r in needed and allocated.get(r, Decimal(0)) + needed[r] > cap
    ]
    return f"Volcano queue {name} is full ({'; '.join(short)})" if short else None


def preempted(pod: Mapping[str, Any]) -> str | None:
    """The scheduler's message when it preempted this pod (the pod is being deleted for a pod
    of higher priority), else None."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if (
            condition.get("type") == DISRUPTION_TARGET
            and condition.get("status") == "True"
            and condition.get("reason") == PREEMPTION_REASON
        ):
            return str(condition.get("message") or "preempted to accommodate a higher priority pod")
    return None
