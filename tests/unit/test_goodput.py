"""Goodput and recovery arithmetic against hand-computed timelines (dtjob.operator.goodput,
dtjob.operator.recoveries): a rewind to a checkpoint, a restart in place, overlapping faults and
a failure during a planned rescale."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from dtjob.operator import recoveries
from dtjob.operator.goodput import Ledger, Sample, eta, ratio, record


def fold(start: float, *samples: Sample) -> Ledger:
    ledger = Ledger(start=start)
    for s in samples:
        ledger = record(ledger, s)
    return ledger


def test_a_crash_rewinds_to_the_checkpoint_and_the_steps_past_it_are_redone() -> None:
    # Gang 0 steps 1 s per step from t=9; it dies at t=32 with checkpoint 20; gang 1 resumes at
    # step 20 and is first seen at step 23 (t=50), then steps to 33 by t=60.
    ledger = fold(
        0.0,
        Sample(10, 1, "0"),  # first sample: its time is not known
        Sample(20, 11, "0"),  # 10 s for steps 2..11
        Sample(30, 21, "0"),  # 10 s for steps 12..21
        Sample(50, 23, "1", resume_step=20),  # 21 was reached before: 1 redone; 22, 23 kept
        Sample(60, 33, "1", resume_step=20),
    )
    assert ledger.kept_seconds == pytest.approx(30.0)
    assert ledger.steps_redone == 1
    assert ledger.highest_step == 33
    assert ratio(ledger, now=60) == pytest.approx(0.5)


def test_a_rewind_in_place_counts_the_redone_steps_of_every_interval_once() -> None:
    # Restarted in place at t=25 from checkpoint 15: steps 16..20 are done twice.
    ledger = fold(
        0.0,
        Sample(10, 10, "0.0"),
        Sample(20, 20, "0.0"),  # 10 s kept
        Sample(30, 17, "0.1", resume_step=15),  # 16, 17 redone
        Sample(40, 27, "0.1", resume_step=15),  # 18..20 redone (3 of 10 steps), 21..27 kept: 7 s
    )
    assert ledger.steps_redone == 5
    assert ledger.kept_seconds == pytest.approx(17.0)
    assert ratio(ledger, now=40) == pytest.approx(17 / 40)


def test_a_step_going_back_in_the_same_gang_is_a_rewind_too() -> None:
    ledger = fold(
        0.0,
        Sample(10, 10, "0"),
        Sample(20, 20, "0"),
        Sample(30, 12, "0", resume_step=10),
        Sample(40, 22, "0", resume_step=10),
    )
    assert ledger.steps_redone == 10, "steps 11..20"
    assert ledger.kept_seconds == pytest.approx(10 + 10 * 2 / 10)


def test_a_step_that_does_not_move_keeps_the_interval_open() -> None:
    ledger = fold(0.0, Sample(10, 5, "0"), Sample(20, 5, "0"), Sample(30, 15, "0"))
    assert ledger.kept_seconds == pytest.approx(20.0), "a 20 s interval for steps 6..15"


def test_eta_follows_the_recent_rate_and_needs_the_total() -> None:
    ledger = fold(0.0, Sample(10, 0, "0"), Sample(20, 10, "0"))  # 1 step/s
    assert eta(ledger, total_steps=100) == pytest.approx(20 + 90)
    assert eta(ledger, total_steps=None) is None
    slower = record(ledger, Sample(40, 20, "0"))  # 0.5 step/s now: 0.3 * 0.5 + 0.7 * 1 = 0.85
    assert slower.steps_per_second == pytest.approx(0.85)
    assert eta(slower, total_steps=100) == pytest.approx(40 + 80 / 0.85)
    assert eta(record(slower, Sample(50, 21, "1", resume_step=20)), total_steps=100) is None, "new gang"


def test_a_failure_during_a_rescale_keeps_the_steps_its_checkpoint_saved() -> None:
    # A planned rescale checkpoints at the highest step (30): the new gang fails before it steps,
    # the next one resumes from 30 as well: nothing is redone.
    ledger = fold(
        0.0,
        Sample(10, 10, "0"),
        Sample(30, 30, "0"),
        Sample(60, 32, "2", resume_step=30),
        Sample(70, 42, "2", resume_step=30),
    )
    assert ledger.steps_redone == 0
    assert ledger.kept_seconds == pytest.approx(30.0)
    assert ratio(ledger, now=100) == pytest.approx(0.3)


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_overlapping_faults_never_count_a_second_twice() -> None:
    records, closed = recoveries.open_recovery(
        [],
        cause="Signal",
        reason="WorkerFailed",
        detected_at=at(100),
        detection_seconds=2,
        steps_redone=4,
        size_before=4,
        size_after=4,
    )
    assert closed is None and recoveries.is_open(records[-1])
    # a node is lost (at 106, seen at 110) while the new gang starts: the first ends at 106
    records, closed = recoveries.open_recovery(
        records,
        cause="NodeLost",
        reason="NodeLost",
        detected_at=at(110),
        detection_seconds=4,
        steps_redone=0,
        size_before=4,
        size_after=3,
    )
    assert closed is not None and closed["downtimeSeconds"] == 8
    records, closed = recoveries.close(records, at(130))
    assert closed is not None and closed["downtimeSeconds"] == 24
    assert sum(r["downtimeSeconds"] for r in records) == 130 - 98
    assert recoveries.close(records, at(140)) == (records, None), "nothing open"
    assert recoveries.summary(records[0]) == (
        "recovered from Signal (WorkerFailed): detected in 2s, down 8s, 4 steps redone, world size 4 -> 4"
    )


def test_a_failure_during_a_planned_rescale_and_the_bound_on_records() -> None:
    records, _ = recoveries.open_recovery(
        [],
        cause="PlannedRescale",
        reason="ScaleUp",
        detected_at=at(200),
        detection_seconds=0,
        steps_redone=0,
        size_before=2,
        size_after=4,
    )
    records, closed = recoveries.open_recovery(
        records,
        cause="ExitCode",
        reason="WorkerFailed",
        detected_at=at(205),
        detection_seconds=1,
        steps_redone=0,
        size_before=4,
        size_after=4,
    )
    assert closed is not None and (closed["cause"], closed["downtimeSeconds"]) == ("PlannedRescale", 4)
    for i in range(20):
        records, _ = recoveries.open_recovery(
            records,
            cause="Hang",
            reason="PeerLost",
            detected_at=at(300 + i),
            detection_seconds=0,
            steps_redone=0,
            size_before=4,
            size_after=4,
        )
    assert len(records) == recoveries.KEPT
    assert records[-1]["detectedAt"] == "2026-01-01T00:05:19Z"


def test_causes_are_a_bounded_set() -> None:
    assert recoveries.cause_of("WorkerFailed", 137) == "Signal"
    assert recoveries.cause_of("WorkerFailed", 1) == "ExitCode"
    assert recoveries.cause_of("ProgressDeadlineExceeded") == "Hang"
    assert recoveries.cause_of("ScaleDown") == "PlannedRescale"
    assert recoveries.cause_of("Preempted") == "Preemption"
    assert recoveries.exit_code_in("rank 1 (pod 1) exited 137 (SIGKILL)") == 137
    assert {
        recoveries.cause_of(r, c)
        for r in ("NodeLost", "PeerLost", "WorkerDeleted", "X")
        for c in (None, 1, 143)
    } <= set(recoveries.CAUSES)


def test_a_gangs_first_sample_keeps_the_time_since_its_first_step_when_rank_0_says_it() -> None:
    """The first scrape of a new rank 0 came at step 10, 9 s after its first step: steps 2-10
    took those 9 s, all kept. Without the first step's time they were lost (the e2e's steady job
    read 6 points of goodput too few)."""
    ledger = fold(0.0, Sample(11.0, 10, "0.0", 0, first_step_time=2.0))
    assert (ledger.kept_seconds, ledger.steps_per_second) == (9.0, 1.0)
    assert fold(0.0, Sample(11.0, 10, "0.0", 0)).kept_seconds == 0.0


def test_a_new_gangs_late_first_sample_splits_its_time_between_redone_and_new_steps() -> None:
    """Highest step 13, the new gang resumed from 10, did step 11 at 19 s and is seen at 16 at
    23 s: steps 12-16 took 4 s, of which 14-16 are new (3/5 of 4 s) and 11-13 redone."""
    before = fold(0.0, Sample(1.0, 1, "0.0"), Sample(13.0, 13, "0.0"))
    after = record(before, Sample(23.0, 16, "1.0", 10, first_step_time=19.0))
    assert after.steps_redone == 3
    assert after.kept_seconds - before.kept_seconds == pytest.approx(4.0 * 3 / 5)
