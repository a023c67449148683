"""Goodput: the share of a job's wall time that went into steps that were kept.

Pure arithmetic for the reconciler, folded over rank 0's step as the operator samples it (one
`Sample` per scrape that moved the step, or per gang). Time between two samples of the same gang
goes to the steps done in between, in proportion; of those, a step whose number was reached
before (after a rewind to a checkpoint) is redone, and its share of the time is lost. Time while
no gang steps (waiting for pods, restarting, loading a checkpoint) belongs to no sample interval
and is lost too.

The first sample of a gang (a new generation, or a restart in place) starts a new interval: the
steps it shows beyond the highest step reached before are kept. The time they took runs from the
gang's first step (rank 0 says when it completed it) to the sample; the first step's own time is
not counted (the gang's start: loading, warm-up). Without that time (an older trainer) none is
counted: the first scrape of a new rank 0 can come 8 s late (the scrape's backoff), which cost a
steady job 6 points of goodput. The steps it shows at or below the highest step, from the
checkpoint the gang resumed from, are redone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Weight of the newest interval in the recent step rate (ETA): 0.3 follows a change of world size
# within about 5 samples, and one slow step (a checkpoint write) moves the ETA by a third of it.
RATE_WEIGHT = 0.3


@dataclass(frozen=True)
class Sample:
    """Rank 0's step at `time` (unix seconds), in the gang `gang` (a new value: a new gang, or one
    restarted in place), which resumed from the checkpoint at `resume_step` (0: none) and
    completed its first step, resume_step + 1, at `first_step_time` (None: not known)."""

    time: float
    step: int
    gang: str
    resume_step: int = 0
    first_step_time: float | None = None


@dataclass(frozen=True)
class Ledger:
    """What the job's steps were worth so far; `start` is when the job started (unix seconds)."""

    start: float
    kept_seconds: float = 0.0
    steps_redone: int = 0
    highest_step: int = 0
    last: Sample | None = None
    steps_per_second: float | None = None  # recent rate of the current gang (None: not known)


def record(ledger: Ledger, sample: Sample) -> Ledger:
    """The ledger after one more sample."""
    last, highest = ledger.last, ledger.highest_step
    if last is None or sample.gang != last.gang or sample.step < last.step:
        # A new gang (or a rewind in place): it redid the steps from its checkpoint up to the
        # highest one reached before; the time of what it shows is not known.
        redone = max(0, min(sample.step, highest) - sample.resume_step)
        kept, rate = 0.0, None
        first, since = sample.resume_step + 1, sample.first_step_time
        new_gang = last is None or sample.gang != last.gang
        if new_gang and since is not None and since < sample.time and sample.step > first:
            done, seconds = sample.step - first, sample.time - since
            kept = seconds * max(0, sample.step - max(first, highest)) / done
            rate = done / seconds
        return replace(
            ledger,
            kept_seconds=ledger.kept_seconds + kept,
            steps_redone=ledger.steps_redone + redone,
            highest_step=max(highest, sample.step),
            last=sample,
            steps_per_second=rate,
        )
    if sample.step == last.step:
        return ledger  # the interval runs on until the step moves (a slow step, or a hang)
    done = sample.step - last.step
    fresh = max(0, sample.step - max(last.step, highest))
    seconds = max(0.0, sample.time - last.time)
    rate = done / seconds if seconds > 0 else None
    if rate is not None and ledger.steps_per_second is not None:
        rate = RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * ledger.steps_per_second
    return replace(
        ledger,
        kept_seconds=ledger.kept_seconds + seconds * fresh / done,
        steps_redone=ledger.steps_redone + done - fresh,
        highest_step=max(highest, sample.step),
        last=sample,
        steps_per_second=rate if rate is not None else ledger.steps_per_second,
    )


def ratio(ledger: Ledger, now: float) -> float:
    """Kept-step time over wall time since the job started (0 before any time passed)."""
    wall = now - ledger.start
    return 0.0 if wall <= 0 else min(1.0, ledger.kept_seconds / wall)


def eta(ledger: Ledger, total_steps: int | None) -> float | None:
    """When the job reaches `total_steps` at its recent step rate (unix seconds), or None when the
    total or the rate is not known."""
    last, rate = ledger.last, ledger.steps_per_second
    if total_steps is None or last is None or rate is None or rate <= 0:
        return None
    return last.time + max(0, total_steps - last.step) / rate
