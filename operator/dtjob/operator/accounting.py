"""The job's progress, ETA, goodput and recoveries on its status (#43), for the reconciler.

Functions over the status dict a pass is building (camelCase, as written). They change it only
when rank 0's step moved, a gang stopped, or the job finished: passes that already write the
status (a new step is written at the scrape cadence), so accounting adds no status writes.

A job keeps accounts from its start (`start` puts status.goodput in place): a job an operator
without them started has no known history, and gets none of these fields.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from dtjob.operator import goodput, recoveries
from dtjob.operator.goodput import Ledger, Sample
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.timefmt import from_rfc3339, to_rfc3339

# Digits kept of the rates and the ratio: finer ones would change the status at each sample for
# nothing a reader sees.
DIGITS = 4


def gang_of(status: dict[str, Any], progress: TrainerProgress | None = None) -> str:
    """The running gang: its generation, and its restarts in place (as rank 0 reports them)."""
    in_place = progress.in_place_restarts if progress is not None else None
    if in_place is None:
        in_place = int(status.get("inPlaceRestarts") or 0)
    return f"{int(status.get('generation') or 0)}.{in_place}"


def start(status: dict[str, Any], now: datetime) -> None:
    """The job starts: its wall time counts from now."""
    _write_goodput(status, Ledger(start=_whole(now)), _whole(now))


def _ledger(status: dict[str, Any], now: datetime) -> Ledger:
    kept = status.get("goodput") or {}
    start = from_rfc3339(kept.get("since")) or from_rfc3339(status.get("startTime")) or now
    sample = kept.get("sample")
    return Ledger(
        start=start.timestamp(),
        kept_seconds=float(kept.get("keptSeconds") or 0.0),
        steps_redone=int(kept.get("stepsRedone") or 0),
        highest_step=int(kept.get("highestStep") or 0),
        last=Sample(_seconds(sample["time"]), int(sample["step"]), str(sample["gang"])) if sample else None,
        steps_per_second=(status.get("progress") or {}).get("stepsPerSecond"),
    )


def _seconds(text: str) -> float:
    return (from_rfc3339(text) or datetime.fromtimestamp(0, UTC)).timestamp()


def _whole(now: datetime) -> float:
    """`now` to the second, as the status's timestamps hold it."""
    return now.replace(microsecond=0).timestamp()


def _write_goodput(status: dict[str, Any], ledger: Ledger, now: float) -> None:
    last = ledger.last
    sample = {"time": _rfc3339(last.time), "step": last.step, "gang": last.gang} if last else None
    status["goodput"] = {
        "ratio": round(goodput.ratio(ledger, now), DIGITS),
        "keptSeconds": round(ledger.kept_seconds, 3),
        "stepsRedone": ledger.steps_redone,
        "highestStep": ledger.highest_step,
        "since": _rfc3339(ledger.start),
        **({"sample": sample} if sample else {}),
    }


def _rfc3339(unix: float) -> str:
    return to_rfc3339(datetime.fromtimestamp(unix, UTC))


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, DIGITS)


def sample(status: dict[str, Any], progress: TrainerProgress, now: datetime) -> dict[str, Any] | None:
    """Fold rank 0's step into the status (progress, goodput, eta). Returns the recovery it closed:
    the open one, once its new gang's step is past the checkpoint it resumed from."""
    if not progress.step or status.get("goodput") is None:
        return None  # a trainer still starting says nothing; a job without accounts gets none
    now = now.replace(microsecond=0)  # as the status's timestamps hold it
    gang = gang_of(status, progress)
    # Where this gang resumed from; from a trainer that does not say, its newest checkpoint
    resume = progress.resumed_step if progress.resumed_step is not None else progress.checkpoint_step or 0
    before = _ledger(status, now)
    ledger = goodput.record(
        before, Sample(_whole(now), progress.step, gang, resume, progress.first_step_time)
    )
    if ledger != before:
        _write_goodput(status, ledger, _whole(now))
    total = progress.total_steps or (status.get("progress") or {}).get("totalSteps")
    shown = {
        "step": progress.step,
        "totalSteps": total,
        "tokensPerSecond": _rounded(progress.tokens_per_second or None),  # 0: before a first step
        "modelFlopsUtilization": _rounded(progress.mfu or None),  # 0: the device's peak is unknown
        "stepsPerSecond": _rounded(ledger.steps_per_second),
    }
    status["progress"] = {k: v for k, v in shown.items() if v is not None}
    when = goodput.eta(ledger, total)
    status["eta"] = None if when is None else _rfc3339(when)
    records = status.get("recoveries") or []
    detected = from_rfc3339(records[-1]["detectedAt"]) if records else None
    if progress.step <= resume or detected is None or detected >= now:
        return None  # not stepping yet, or a restart in place this very pass found
    # The new gang stepped again when its rank 0 says (a scrape sees it 1-8 s late), not after
    # this pass (a pod's clock may run ahead).
    stepped = now
    if progress.first_step_time is not None:
        stepped = min(now, datetime.fromtimestamp(progress.first_step_time, UTC))
    state_time = (
        progress.resumed_state_time if progress.resumed_step is not None else progress.checkpoint_time
    )
    written = None if state_time is None else datetime.fromtimestamp(state_time, UTC)
    records, closed = recoveries.close(records, stepped, written)
    if closed is not None:
        status["recoveries"] = records
    return closed


def restarted(
    status: dict[str, Any],
    *,
    reason: str,
    now: datetime,
    failed_at: datetime | None,
    exit_code: int | None,
    planned: bool,
    size_before: int,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Record a stop of the gang (status.generation/replicas already hold the new gang). Returns
    the new record (None: the job keeps no accounts) and the one an overlapping failure closed."""
    if status.get("goodput") is None:
        return None, None
    now = now.replace(microsecond=0)
    # The highest step reached, not status.step: a rewind in place already moved that back.
    step = max(int(status.get("step") or 0), int(status["goodput"].get("highestStep") or 0))
    checkpoint = int((status.get("lastCheckpoint") or {}).get("step") or 0)
    records, closed = recoveries.open_recovery(
        status.get("recoveries") or [],
        cause=recoveries.cause_of(reason, exit_code),
        reason=reason,
        detected_at=now,
        detection_seconds=0.0 if failed_at is None or planned else (now - failed_at).total_seconds(),
        steps_redone=0 if planned else step - checkpoint,
        size_before=size_before,
        size_after=int(status.get("replicas") or 0),
    )
    status["recoveries"] = records
    status["eta"] = None  # no gang steps until the next one runs
    return records[-1], closed


def finished(status: dict[str, Any], now: datetime, succeeded: bool) -> dict[str, Any] | None:
    """The job succeeded or failed: goodput over its whole wall time, no ETA, and the open
    recovery (if any) closed. Returns that recovery. The steps of a success after the last
    sample (to its final status.step) count as kept, with the time to its end."""
    if status.get("goodput") is None:
        return None
    now = now.replace(microsecond=0)
    ledger = _ledger(status, now)
    last, final = ledger.last, int(status.get("step") or 0)
    if succeeded and last is not None and final > last.step:
        ledger = goodput.record(ledger, Sample(now.timestamp(), final, last.gang))
    _write_goodput(status, ledger, now.timestamp())
    status["eta"] = None
    records, closed = recoveries.close(status.get("recoveries") or [], now)
    if closed is not None:
        status["recoveries"] = records
    return closed
