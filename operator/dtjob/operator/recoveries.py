"""The job's recoveries: each time the gang stopped and came back, what it cost (status.recoveries).

Pure functions over the status's list of records (camelCase dicts, as written). A recovery opens
when the operator decides a new gang (or counts a restart in place) and closes when the new gang's
step is seen moving, or when the job finishes. Its downtime runs from the failure (its detection
time less the detection seconds) to that close; a second failure before the close ends the first
recovery's downtime at the second failure, so overlapping faults never count a second twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from dtjob.operator.timefmt import from_rfc3339, to_rfc3339

# The newest records kept on the status: 10 x ~250 bytes keeps the object small at any restart count.
KEPT = 10

# Causes (the label `cause` of the operator's per-job metrics: a bounded set).
EXIT_CODE, SIGNAL, HANG, NODE_LOST = "ExitCode", "Signal", "Hang", "NodeLost"
PLANNED_RESCALE, PREEMPTION, POD_DELETED = "PlannedRescale", "Preemption", "PodDeleted"
CAUSES = (EXIT_CODE, SIGNAL, HANG, NODE_LOST, PLANNED_RESCALE, PREEMPTION, POD_DELETED)

_BY_REASON = {
    "NodeLost": NODE_LOST,
    "PeerLost": HANG,  # a rank went silent, its peers left
    "ProgressDeadlineExceeded": HANG,
    "Preempted": PREEMPTION,
    "WorkerDeleted": POD_DELETED,
    "WorkerStopped": PLANNED_RESCALE,  # a worker's own exit 75 after a checkpoint
    "ScaleUp": PLANNED_RESCALE,
    "ScaleDown": PLANNED_RESCALE,
    "Unschedulable": PLANNED_RESCALE,  # shrinking to what fits
}
# The event of a recovery that could not use the gang's memory (from_checkpoint).
RECOVERED_FROM_CHECKPOINT = "RecoveredFromCheckpoint"
_EXITED = re.compile(r"exited (\d+)")


def cause_of(reason: str, exit_code: int | None = None) -> str:
    """The cause of a restart the reconciler names `reason`: an exit code above 128 is a signal
    (137: SIGKILL), as the kubelet reports a killed container."""
    if reason in _BY_REASON:
        return _BY_REASON[reason]
    return SIGNAL if exit_code is not None and exit_code > 128 else EXIT_CODE


def exit_code_in(text: str | None) -> int | None:
    """The exit code in a restart cause the agent wrote ("rank 1 (pod 1) exited 137 (SIGKILL)")."""
    found = _EXITED.search(text or "")
    return int(found.group(1)) if found else None


def _failed_at(record: Mapping[str, Any]) -> datetime | None:
    detected = from_rfc3339(record.get("detectedAt"))
    if detected is None:
        return None
    return detected - timedelta(seconds=float(record.get("detectionSeconds") or 0))


def is_open(record: Mapping[str, Any]) -> bool:
    """Whether the gang has not been seen stepping since (an open record has no downtimeSeconds)."""
    return record.get("downtimeSeconds") is None


def close(
    records: Sequence[Mapping[str, Any]], at: datetime, resumed_state_at: datetime | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The records with the open one (the newest, if open) closed at `at`, and that record.
    `resumed_state_at`: when the state the new gang resumed from was written, if known; a planned
    stop's old gang trains on after the decision until it checkpoints, so its downtime starts at
    that checkpoint (a failure's checkpoint is older than the failure: no change)."""
    out = [dict(r) for r in records]
    if not out or not is_open(out[-1]):
        return out, None
    failed = _failed_at(out[-1]) or at
    if resumed_state_at is not None and failed < resumed_state_at <= at:
        failed = resumed_state_at
    out[-1]["downtimeSeconds"] = round(max(0.0, (at - failed).total_seconds()), 1)
    return out, out[-1]


def open_recovery(
    records: Sequence[Mapping[str, Any]],
    *,
    cause: str,
    reason: str,
    detected_at: datetime,
    detection_seconds: float,
    steps_redone: int,
    size_before: int,
    size_after: int,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The records with a new open one (the newest KEPT), and the record an overlapping failure
    closed (None: none was open)."""
    failed = detected_at - timedelta(seconds=max(0.0, detection_seconds))
    out, closed = close(records, failed)
    out.append(
        {
            "cause": cause,
            "reason": reason,
            "detectedAt": to_rfc3339(detected_at),
            "detectionSeconds": round(max(0.0, detection_seconds), 1),
            "stepsRedone": max(0, steps_redone),
            "worldSizeBefore": size_before,
            "worldSizeAfter": size_after,
        }
    )
    return out[-KEPT:], closed


def from_checkpoint(wanted: int | None, resumed: int | None) -> str | None:
    """The message of the event RECOVERED_FROM_CHECKPOINT when a gang resumed from its durable
    checkpoint of step `resumed` though memory held the newer step `wanted` (both copies of a
    shard lost, two pods at once, or damaged); None when it lost nothing."""
    if not wanted or resumed is None or wanted <= resumed:
        return None
    steps = f"step {wanted} is" if wanted - resumed == 1 else f"steps {resumed + 1}-{wanted} are"
    return (
        f"resumed from the durable checkpoint of step {resumed}, not from memory: the in-memory "
        f"snapshot of step {wanted} lost a shard on every pod that held it (or was damaged; the "
        f"trainers' logs say which), so {steps} computed again"
    )


def summary(record: Mapping[str, Any]) -> str:
    """The one-line account of a closed recovery (its Event's message)."""
    r = record
    found = f"recovered from {r['cause']} ({r['reason']}): detected in {r['detectionSeconds']:g}s"
    cost = f"down {r['downtimeSeconds']:g}s, {r['stepsRedone']} steps redone"
    return f"{found}, {cost}, world size {r['worldSizeBefore']} -> {r['worldSizeAfter']}"
