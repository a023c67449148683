"""What the operator reads from workers: rank 0's Prometheus gauges and a finished rank 0's log."""

from __future__ import annotations

from dtjob.operator.kube import final_state_from_log
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.scrape import parse_trainer_metrics

EXPOSITION = """# HELP dtjob_trainer_step Last completed step
# TYPE dtjob_trainer_step gauge
dtjob_trainer_step 42.0
dtjob_trainer_last_checkpoint_step{job="gpt"} 40.0
dtjob_trainer_last_checkpoint_timestamp_seconds 1.7e9
python_gc_objects_collected_total{generation="0"} 123.0
"""


def test_trainer_gauges_are_read_from_exposition_text() -> None:
    assert parse_trainer_metrics(EXPOSITION) == TrainerProgress(42, 40, 1.7e9, checkpoints_published=True)


def test_refused_checkpoint_writes_are_read_and_absent_means_not_reported() -> None:
    text = EXPOSITION + "dtjob_trainer_checkpoint_write_failures 2.0\n"
    assert parse_trainer_metrics(text).checkpoint_failures == 2
    assert parse_trainer_metrics(EXPOSITION).checkpoint_failures is None


def test_no_checkpoint_yet_reads_as_none() -> None:
    text = "dtjob_trainer_step 3\ndtjob_trainer_last_checkpoint_step -1\n"
    assert parse_trainer_metrics(text) == TrainerProgress(3, None, None, checkpoints_published=True)
    assert parse_trainer_metrics("dtjob_trainer_step 3\n") == TrainerProgress(3), (
        "a trainer without checkpoints"
    )


def test_final_state_from_json_step_lines_or_the_closing_line() -> None:
    json_log = '{"step": 29, "loss": 2.0}\n{"step": 30, "loss": 1.9}\nINFO checkpoint written\n'
    assert final_state_from_log(json_log) == TrainerProgress(step=30)
    quiet_log = "dtjob-trainer[rank 0] 14:23:29 INFO training complete at step 60\n"
    assert final_state_from_log(quiet_log) == TrainerProgress(step=60)
    closing = "INFO training complete at step 30; last checkpoint step 30 at 1764425000.250\n"
    assert final_state_from_log(json_log + closing) == TrainerProgress(30, 30, 1764425000.25)
    assert final_state_from_log("Traceback (most recent call last):\n") is None


def test_restarts_in_place_and_their_cause_are_read_from_the_label() -> None:
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()  # the trainer's own exposition of it (dtjob.trainer.metrics)
    gauge = Gauge("dtjob_trainer_in_place_restarts", "restarts in place", ("cause",), registry=registry)
    gauge.labels('rank 1 (pod 1) exited 137 (SIGKILL) "x"\\y').set(2)
    progress = parse_trainer_metrics(EXPOSITION + generate_latest(registry).decode())
    assert (progress.in_place_restarts, progress.restart_cause) == (
        2,
        'rank 1 (pod 1) exited 137 (SIGKILL) "x"\\y',
    )
    assert parse_trainer_metrics(EXPOSITION).in_place_restarts is None
    first = parse_trainer_metrics('dtjob_trainer_in_place_restarts{cause=""} 0.0\n')
    assert (first.in_place_restarts, first.restart_cause) == (0, None)
