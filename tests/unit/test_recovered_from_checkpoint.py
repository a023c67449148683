"""A gang that resumed from its durable checkpoint although its memory held a newer step (both
copies of a shard lost: two pods at once) says so: rank 0 serves the step it wanted
(METRIC_RESUME_LOST_STEP) beside the one it got (METRIC_RESUMED_STEP), and the operator emits the
event RecoveredFromCheckpoint, once, when that recovery closes."""

from __future__ import annotations

from typing import Any

from dtjob import contract
from dtjob.operator import accounting, recoveries
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.scrape import parse_trainer_metrics
from tests.unit.reconciler_fixtures import applied, at, events, gang, make_job, run, running_status, two_nodes

CAUSE = "rank 1 (pod 0) exited 137 (SIGKILL)"


def _trainer(step: int, resumed: int, lost: int | None) -> TrainerProgress:
    return TrainerProgress(
        step=step,
        checkpoint_step=5,
        checkpoint_time=at(0).timestamp(),
        checkpoints_published=True,
        in_place_restarts=1,
        restart_cause=CAUSE,
        resumed_step=resumed,
        resumed_state_time=at(0).timestamp(),
        resume_lost_step=lost,
    )


def _restarted_job() -> dict[str, Any]:
    """A job at step 7 (checkpoint 5) whose gang was just restarted in place."""
    status = running_status(since=0)
    accounting.start(status, at(0))
    job = make_job(status=status, elastic={"restartInPlace": True})
    job = applied(job, run(job, gang(4), two_nodes(), now=10, progress=_trainer(7, 0, None)))
    return applied(job, run(job, gang(4), two_nodes(), now=20, progress=_trainer(5, 5, 7)))


def test_the_event_names_the_durable_step_and_the_steps_redone_once() -> None:
    job = _restarted_job()
    actions = run(job, gang(4), two_nodes(), now=30, progress=_trainer(8, 5, 7))
    fell_back = [e for e in events(actions) if e.reason == recoveries.RECOVERED_FROM_CHECKPOINT]
    assert [(e.type, e.message) for e in fell_back] == [
        (
            "Warning",
            "resumed from the durable checkpoint of step 5, not from memory: the in-memory snapshot of "
            "step 7 lost a shard on every pod that held it (or was damaged; the trainers' logs say "
            "which), so steps 6-7 are computed again",
        )
    ]
    assert "GangRecovered" in [e.reason for e in events(actions)]
    job = applied(job, actions)
    again = run(job, gang(4), two_nodes(), now=40, progress=_trainer(9, 5, 7))
    assert recoveries.RECOVERED_FROM_CHECKPOINT not in [e.reason for e in events(again)], "said once"


def test_a_resume_from_memory_emits_no_such_event() -> None:
    job = _restarted_job()
    for lost in (None, 0, 5):  # not served, nothing lost, lost only what the checkpoint has
        actions = run(job, gang(4), two_nodes(), now=30, progress=_trainer(8, 5, lost))
        assert "GangRecovered" in [e.reason for e in events(actions)]
        assert recoveries.RECOVERED_FROM_CHECKPOINT not in [e.reason for e in events(actions)]


def test_the_message_and_the_scraped_gauge() -> None:
    assert (recoveries.from_checkpoint(7, 6) or "").endswith("so step 7 is computed again")
    assert (recoveries.from_checkpoint(12, 0) or "").endswith("so steps 1-12 are computed again")
    assert recoveries.from_checkpoint(None, 5) is None and recoveries.from_checkpoint(7, None) is None
    text = f"{contract.METRIC_RESUMED_STEP} 5.0\n{contract.METRIC_RESUME_LOST_STEP} 7.0\n"
    progress = parse_trainer_metrics(text)
    assert (progress.resumed_step, progress.resume_lost_step) == (5, 7)
    assert parse_trainer_metrics(f"{contract.METRIC_RESUME_LOST_STEP} 0.0\n").resume_lost_step is None
