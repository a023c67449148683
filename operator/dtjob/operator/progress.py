"""What the operator knows of a trainer's progress, and what it concludes from not knowing.

Pure functions for the reconciler. Rank 0's metrics endpoint says the step and the last
checkpoint (`TrainerProgress`); a trainer that is not dtjob's may publish neither. The condition
MetricsAvailable records what the trainer was seen to publish, and is the job's memory of it
across passes and generations (the template, hence the trainer, is immutable):

- True, StepAndCheckpoints: planned rescales wait for the generation's first checkpoint.
- True, StepOnly: the step is seen (progressDeadlineSeconds works); rescales do not wait.
- False, NoStepMetric / NoMetrics: the operator sees neither; rescales do not wait, and
  progressDeadlineSeconds is not enforced.

A failed scrape never turns a True into a False: only a generation that ran longer than
`metrics_grace_seconds` without rank 0 ever answering does, and an answer later turns it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dtjob import contract

METRICS_AVAILABLE = "MetricsAvailable"
STEP_AND_CHECKPOINTS, STEP_ONLY = "StepAndCheckpoints", "StepOnly"
NO_STEP_METRIC, NO_METRICS = "NoStepMetric", "NoMetrics"


@dataclass(frozen=True)
class TrainerProgress:
    """What the operator read of rank 0's progress: from its Prometheus endpoint while it runs,
    from the closing line of its log once it finished (None: not reported)."""

    step: int | None = None
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None  # unix seconds
    # The endpoint has the last-checkpoint gauge (even before a first checkpoint, at 0 or -1).
    checkpoints_published: bool = False
    # Periodic checkpoint writes the volume refused since the last one that succeeded.
    checkpoint_failures: int | None = None
    # Restarts in place of this generation before rank 0 started, and what failed before the last.
    in_place_restarts: int | None = None
    restart_cause: str | None = None
    restart_failed_at: float | None = None  # unix seconds
    # When rank 0's process completed its first step (unix seconds; None: not yet, or unknown).
    first_step_time: float | None = None
    # The step rank 0's process resumed from (0: the start) and when that state was written.
    resumed_step: int | None = None
    resumed_state_time: float | None = None
    # The newest step the gang's in-memory snapshots held but could not restore when rank 0's
    # process resumed from its durable checkpoint instead (None or 0: nothing lost).
    resume_lost_step: int | None = None
    # The run's total steps, and the global tokens/s and MFU of rank 0's last step (#43).
    total_steps: int | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None


@dataclass(frozen=True)
class Availability:
    """A value of the MetricsAvailable condition."""

    value: bool
    reason: str
    message: str


def metrics_availability(
    progress: TrainerProgress | None,
    known: Mapping[str, Any] | None,
    running_seconds: float,
    grace_seconds: float,
    metrics_port: int,
) -> Availability | None:
    """MetricsAvailable after a scrape of a running generation's rank 0 (`progress` None: it did
    not answer), given the condition so far (`known`); None: leave the condition as it is."""
    cannot = "the operator cannot see steps (progressDeadlineSeconds is not enforced) or checkpoints"
    if progress is not None and progress.step is not None:
        if progress.checkpoints_published:
            return Availability(True, STEP_AND_CHECKPOINTS, "rank 0 publishes its step and checkpoints")
        return Availability(
            True,
            STEP_ONLY,
            f"rank 0 publishes {contract.METRIC_STEP} but no {contract.METRIC_LAST_CHECKPOINT_STEP}: "
            "planned rescales do not wait for a checkpoint",
        )
    if progress is not None:
        return Availability(
            False,
            NO_STEP_METRIC,
            f"rank 0 serves metrics on port {metrics_port} without {contract.METRIC_STEP}: {cannot} "
            "(planned rescales do not wait for one)",
        )
    if (known or {}).get("status") == "True" or running_seconds < grace_seconds:
        return None
    return Availability(
        False,
        NO_METRICS,
        f"rank 0 served no metrics on port {metrics_port} in {grace_seconds:g}s of running: {cannot} "
        "(planned rescales do not wait for one)",
    )


def publishes_checkpoints(condition: Mapping[str, Any] | None, ever_checkpointed: bool) -> bool | None:
    """Whether the trainer reports its checkpoints: True, False, or None (not known yet)."""
    if ever_checkpointed:
        return True
    if condition is None or condition.get("status") == "Unknown":
        return None
    return condition.get("status") == "True" and condition.get("reason") == STEP_AND_CHECKPOINTS


def publishes_step(condition: Mapping[str, Any] | None) -> bool:
    return (condition or {}).get("status") == "True"


def stalled_for(
    now: datetime, last_progress: datetime | None, running_since: datetime | None
) -> float | None:
    """Seconds since the step last advanced in this generation (None: not running)."""
    if running_since is None:
        return None
    since = max(running_since, last_progress) if last_progress is not None else running_since
    return (now - since).total_seconds()
