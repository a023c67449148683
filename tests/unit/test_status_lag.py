"""bench/scale.py's status lag (dtjob.devcluster.status_lag) on hand-made watch records."""

from __future__ import annotations

import math

from dtjob.devcluster.scale_harness import PodRecord
from dtjob.devcluster.status_lag import JobVersion, percentile, status_lags, summary


def pod(rank: int, running: float | None, failed: float | None = None, generation: int = 0) -> PodRecord:
    return PodRecord(
        f"a-worker-{rank}",
        f"uid-{generation}-{rank}",
        "a",
        rank,
        generation,
        0.0,
        running=running,
        failed=failed,
    )


def test_each_running_worker_waits_for_the_first_version_that_counts_it() -> None:
    pods = [pod(0, 1.0), pod(1, 2.0)]
    versions = {
        "a": [
            JobVersion(0.5, 0, "Pending", 0),
            JobVersion(1.4, 0, "Pending", 1),  # rank 0: 0.4 s
            JobVersion(5.0, 0, "Running", 2),  # rank 1: 3.0 s (the ready count of 1 was not enough)
        ]
    }
    assert [round(v, 6) for v in status_lags(pods, versions)["running"]] == [0.4, 3.0]


def test_a_failure_shows_when_the_job_restarts_or_moves_past_its_generation() -> None:
    pods = [pod(0, 1.0), pod(1, 1.0, failed=4.0), pod(0, 9.0, generation=1), pod(1, 9.0, generation=1)]
    versions = {
        "a": [
            JobVersion(1.2, 0, "Running", 2),
            JobVersion(4.5, 0, "Restarting", 2),  # still counts 2 ready: only the phase says it
            JobVersion(9.3, 1, "Running", 2),
        ]
    }
    lags = status_lags(pods, versions)
    assert [round(v, 6) for v in lags["failed"]] == [0.5]
    assert [round(v, 6) for v in lags["running"]] == [0.2, 0.2, 0.3, 0.3]


def test_a_change_no_version_shows_is_unbounded_and_one_shown_first_is_zero() -> None:
    pods = [pod(0, 3.0), pod(1, 6.0)]
    versions = {"a": [JobVersion(2.9, 0, "Pending", 1)]}  # the operator's watch was ahead of ours
    lags = status_lags(pods, versions)["running"]
    assert lags[0] == 0.0 and math.isinf(lags[1])
    assert summary({"running": lags})["running"] == {"n": 2, "p50_s": 0.0, "p99_s": None, "max_s": None}


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.5) == 50.0
    assert percentile([], 0.5) is None
