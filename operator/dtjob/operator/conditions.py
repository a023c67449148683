"""Conditions of Kubernetes objects (`status.conditions`): set one on the job, read when one of a
pod or node last changed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from dtjob.operator.timefmt import from_rfc3339, to_rfc3339


def with_condition(
    conditions: Sequence[Mapping[str, Any]],
    ctype: str,
    value: bool | None,
    reason: str,
    message: str,
    now: datetime,
) -> list[dict[str, Any]]:
    """`conditions` with the one of type `ctype` set (value None: status Unknown);
    lastTransitionTime moves only when the status changes."""
    updated = [dict(c) for c in conditions]
    wanted = "Unknown" if value is None else "True" if value else "False"
    for cond in updated:
        if cond.get("type") == ctype:
            if cond.get("status") != wanted:
                cond["lastTransitionTime"] = to_rfc3339(now)
            cond.update(status=wanted, reason=reason, message=message)
            return updated
    new = {"type": ctype, "status": wanted, "reason": reason, "message": message}
    return [*updated, {**new, "lastTransitionTime": to_rfc3339(now)}]


def condition_time(status: Mapping[str, Any], ctype: str, value: str | None = "True") -> datetime | None:
    """lastTransitionTime of an object's condition of type ctype (with that status, unless None)."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == ctype and value in (None, condition.get("status")):
            return from_rfc3339(condition.get("lastTransitionTime"))
    return None
