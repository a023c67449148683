"""Restarts and recoveries on the job's status: a new generation (the gang restarted in new pods,
counted or planned), restarts in place counted into status.restarts, and each recovery opened and
closed on status.recoveries and in the job's metrics (dtjob.operator.accounting)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from dtjob.api import JobPhase
from dtjob.operator import accounting, recoveries
from dtjob.operator.actions import CountRescale, CountRestart, JobRecovered, JobRestarted
from dtjob.operator.reconcile_pass import RESTARTING, ReconcilePass


def new_generation(
    p: ReconcilePass,
    size: int,
    reason: str,
    message: str,
    *,
    counted: bool,
    phase: JobPhase = RESTARTING,
    failed_at: datetime | None = None,
    exit_code: int | None = None,
) -> None:
    """Start the next gang: recorded in status first; old pods are deleted by the reconciler's
    _converge_pods (rule 5).
    `failed_at` and `exit_code`: what the job's recovery record says of the failure."""
    old_size = int(p.status.get("replicas") or 0)
    generation = int(p.status.get("generation", -1)) + 1
    p.status["generation"] = generation
    p.status["replicas"] = size
    p.status["worldSize"] = size * p.job.nproc_per_worker
    if p.job.restart_in_place:
        p.status["inPlaceRestarts"] = 0  # the new generation's agents count from 0
    if counted:
        p.status["restarts"] = int(p.status.get("restarts") or 0) + 1
        p.actions.append(CountRestart(reason))
    text = f"generation {generation} with {size} workers: {message}"
    p.set_phase(phase, reason, text, warning=counted)
    if reason != "Resumed" and old_size:  # a resume after suspend is the user's pause, not a recovery
        restarted(p, reason, failed_at, exit_code, planned=not counted, size_before=old_size)
    if old_size and size != old_size:
        direction = "up" if size > old_size else "down"
        p.actions.append(CountRescale(direction, reason))
        if reason not in {"ScaleUp", "ScaleDown"}:
            p.event("Rescale", f"world size {old_size} -> {size}: {message}")


def count_in_place(
    p: ReconcilePass, seen: int, cause: str | None, account: bool = True, failed_at: datetime | None = None
) -> None:
    """Restarts in place of the current generation (elastic.restartInPlace): those not counted yet
    go into status.restarts, with a Warning event. `seen` comes from rank 0's metrics, or from the
    last line of a failed pod's agent (which rank 0's metrics may not have shown yet). `account`:
    a recovery on the job's status; not for an agent's last line, whose gang failed for good after
    restarts whose cost nothing shows (a record would close at once, 0 s down). `failed_at`: when
    the pods' agents saw the failure (rank 0's DTJOB_RESTART_FAILED_AT): the recovery's downtime
    runs from then, not from this pass."""
    counted = int(p.status.get("inPlaceRestarts") or 0)
    if seen <= counted:
        return
    restarts = int(p.status.get("restarts") or 0) + seen - counted
    p.status["restarts"] = restarts
    p.status["inPlaceRestarts"] = seen
    for _ in range(seen - counted):
        p.actions.append(CountRestart("InPlace"))
    if account:
        size = int(p.status.get("replicas") or 0)
        restarted(p, "InPlace", failed_at, recoveries.exit_code_in(cause), planned=False, size_before=size)
    why = f": {cause}" if cause else ""
    p.event(
        "RestartedInPlace",
        f"generation {p.status.get('generation')}: the gang restarted in place ({seen} in this generation, "
        f"{restarts} restarts in all){why}",
        warning=True,
    )


def restarted(
    p: ReconcilePass,
    reason: str,
    failed_at: datetime | None,
    exit_code: int | None,
    *,
    planned: bool,
    size_before: int,
) -> None:
    """A recovery begins: on status.recoveries, and in the job's metrics."""
    record, closed = accounting.restarted(
        p.status,
        reason=reason,
        now=p.now,
        failed_at=failed_at,
        exit_code=exit_code,
        planned=planned,
        size_before=size_before,
    )
    recovered(p, closed)
    if record is not None:
        p.actions.append(JobRestarted(record["cause"], record["stepsRedone"]))


def recovered(p: ReconcilePass, record: Mapping[str, Any] | None) -> None:
    """A recovery ended (`record`, None: none did): its Event and its downtime in the metrics."""
    if record is None:
        return
    p.event("GangRecovered", recoveries.summary(record), warning=False)
    p.actions.append(JobRecovered(record["cause"], float(record["downtimeSeconds"])))
