"""The reconciler keeps the job's accounts (#43): progress, ETA, goodput and recoveries on its
status, a Recovered event per recovery, and the operator's per-job metrics, driven pass by pass
through a SIGKILL and a restart in place with hand-computed numbers."""

from __future__ import annotations

from typing import Any

import pytest

from dtjob import contract
from dtjob.operator import accounting
from dtjob.operator.actions import Action, JobRecovered, JobRestarted
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.scrape import parse_trainer_metrics
from dtjob.operator.timefmt import to_rfc3339
from tests.unit.reconciler_fixtures import (
    applied,
    at,
    events,
    gang,
    make_job,
    make_pod,
    run,
    running_status,
    status_patch,
    two_nodes,
)


def accounted_job(**kw: Any) -> dict[str, Any]:
    """A running job whose accounts started with it, at 0."""
    status = running_status(since=0)
    accounting.start(status, at(0))
    return make_job(status=status, **kw)


def trainer(
    step: int, checkpoint: int, in_place: int | None = None, cause: str | None = None
) -> TrainerProgress:
    return TrainerProgress(
        step=step,
        checkpoint_step=checkpoint or None,
        checkpoint_time=at(0).timestamp(),
        checkpoints_published=True,
        total_steps=100,
        tokens_per_second=2048.0,
        mfu=0.4125,
        in_place_restarts=in_place,
        restart_cause=cause,
    )


def step(
    job: dict[str, Any],
    now: float,
    progress: TrainerProgress,
    pods: list[dict[str, Any]] | None = None,
    metrics: OperatorMetrics | None = None,
) -> tuple[dict[str, Any], list[Action]]:
    actions = run(job, gang(4) if pods is None else pods, two_nodes(), now=now, progress=progress)
    if metrics is not None:  # what the writer does with the actions and the written status
        for a in actions:
            if isinstance(a, JobRestarted | JobRecovered):
                metrics.job_recovery("ml", "gpt", a)
        metrics.job_status("ml", "gpt", applied(job, actions)["status"])
    return applied(job, actions), actions


def sample(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"namespace": "ml", "name": "gpt", **labels})


def test_a_sigkill_costs_its_downtime_and_the_steps_past_the_checkpoint() -> None:
    metrics = OperatorMetrics()
    job = accounted_job()
    job, _ = step(job, 10, trainer(5, 0), metrics=metrics)  # the first sample: its time is not known
    assert job["status"]["progress"] == {
        "step": 5,
        "totalSteps": 100,
        "tokensPerSecond": 2048.0,
        "modelFlopsUtilization": 0.4125,
    }
    assert "eta" not in job["status"] or job["status"]["eta"] is None, "no rate yet"
    job, _ = step(job, 20, trainer(15, 10), metrics=metrics)  # 10 s for steps 6..15: 1 step/s
    assert job["status"]["eta"] == to_rfc3339(at(20 + 85))
    assert sample(metrics, "dtjob_job_eta_seconds") == 85
    job, _ = step(job, 30, trainer(25, 20), metrics=metrics)
    assert job["status"]["goodput"]["ratio"] == pytest.approx(20 / 30, abs=1e-4)

    # rank 2 is SIGKILLed at 31, seen at 32: the next gang redoes steps 21..25
    pods = gang(4)
    pods[2] = make_pod(2, node="n2", phase="Failed", exit_code=137)
    pods[2]["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = to_rfc3339(at(31))
    job, actions = step(job, 32, trainer(25, 20), pods=pods, metrics=metrics)
    assert job["status"]["generation"] == 1
    assert job["status"]["recoveries"] == [
        {
            "cause": "Signal",
            "reason": "WorkerFailed",
            "detectedAt": to_rfc3339(at(32)),
            "detectionSeconds": 1.0,
            "stepsRedone": 5,
            "worldSizeBefore": 4,
            "worldSizeAfter": 4,
        }
    ]
    assert job["status"]["eta"] is None, "no ETA while no gang steps"
    assert JobRestarted("Signal", 5) in actions
    assert "GangRecovered" not in [e.reason for e in events(actions)]
    assert sample(metrics, "dtjob_job_restarts_total", cause="Signal") == 1
    assert sample(metrics, "dtjob_job_steps_redone_total") == 5

    # generation 1 runs; its rank 0 loaded checkpoint 20 at 50 (not stepping yet), is at 30 by 60
    job, actions = step(job, 45, None, pods=gang(4, generation=1))  # type: ignore[arg-type]
    assert job["status"]["phase"] == "Running"
    job, actions = step(job, 50, trainer(20, 20), pods=gang(4, generation=1), metrics=metrics)
    assert "downtimeSeconds" not in job["status"]["recoveries"][-1], "open until the gang steps"
    job, actions = step(job, 60, trainer(30, 20), pods=gang(4, generation=1), metrics=metrics)
    # 50..60 did steps 21..30: 21..25 again (5 s lost), 26..30 new (5 s kept)
    recovery = job["status"]["recoveries"][-1]
    assert recovery["downtimeSeconds"] == 29.0, "from the SIGKILL at 31 to the step moving at 60"
    assert [(e.type, e.reason, e.message) for e in events(actions)] == [
        (
            "Normal",
            "GangRecovered",
            "recovered from Signal (WorkerFailed): detected in 1s, down 29s, "
            "5 steps redone, world size 4 -> 4",
        )
    ]
    kept = job["status"]["goodput"]
    assert (kept["keptSeconds"], kept["stepsRedone"], kept["highestStep"]) == (25.0, 5, 30)
    assert kept["ratio"] == pytest.approx(25 / 60, abs=1e-4)
    assert sample(metrics, "dtjob_job_goodput_ratio") == pytest.approx(25 / 60, abs=1e-4)
    assert sample(metrics, "dtjob_job_recovery_seconds_sum", cause="Signal") == 29
    assert sample(metrics, "dtjob_job_recovery_seconds_bucket", cause="Signal", le="30.0") == 1
    assert sample(metrics, "dtjob_job_recovery_seconds_bucket", cause="Signal", le="20.0") == 0
    assert sample(metrics, "dtjob_job_step") == 30
    assert sample(metrics, "dtjob_job_tokens_per_second") == 2048
    assert sample(metrics, "dtjob_job_model_flops_utilization") == 0.4125

    # the job ends at 70 after step 40: the last 10 steps are kept, the wall time is 70 s
    done = run(
        job,
        gang(4, generation=1, phase="Succeeded", exit_code=0),
        two_nodes(),
        now=70,
        progress=trainer(40, 40),
    )
    final = status_patch(done)["goodput"]
    assert final["ratio"] == pytest.approx(35 / 70, abs=1e-4)

    metrics.job_phase("ml", "gpt", None)  # the job is deleted: its series go
    assert sample(metrics, "dtjob_job_goodput_ratio") is None
    assert sample(metrics, "dtjob_job_restarts_total", cause="Signal") is None
    assert sample(metrics, "dtjob_job_recovery_seconds_count", cause="Signal") is None
    assert sample(metrics, "dtjob_job_steps_redone_total") is None


def test_a_restart_in_place_is_a_recovery_closed_when_the_gang_steps_again() -> None:
    job = accounted_job(elastic={"restartInPlace": True})
    job, _ = step(job, 10, trainer(10, 0))
    job, _ = step(job, 20, trainer(20, 15))
    cause = "rank 1 (pod 1) exited 137 (SIGKILL)"
    job, actions = step(job, 30, trainer(17, 15, in_place=1, cause=cause))
    record = job["status"]["recoveries"][-1]
    assert (record["cause"], record["reason"], record["stepsRedone"]) == ("Signal", "InPlace", 5)
    assert "downtimeSeconds" not in record, "not closed in the pass that found it"
    assert JobRestarted("Signal", 5) in actions
    job, actions = step(job, 40, trainer(27, 15, in_place=1, cause=cause))
    assert job["status"]["recoveries"][-1]["downtimeSeconds"] == 10.0, "from its detection (time unknown)"
    assert [e.reason for e in events(actions)] == ["GangRecovered"]
    assert (job["status"]["goodput"]["stepsRedone"], job["status"]["goodput"]["keptSeconds"]) == (5, 17.0)


def test_a_restart_in_place_counts_its_downtime_from_the_failure_the_agents_saw() -> None:
    """Rank 0's DTJOB_RESTART_FAILED_AT (served as a gauge, parsed from the exposition text) moves
    the recovery's start back to the failure: 4 s of restart before the operator saw the new gang."""
    job = accounted_job(elastic={"restartInPlace": True})
    job, _ = step(job, 10, trainer(10, 0))
    job, _ = step(job, 20, trainer(20, 15))
    text = (
        f"{contract.METRIC_STEP} 17.0\n{contract.METRIC_LAST_CHECKPOINT_STEP} 15.0\n"
        f"{contract.METRIC_LAST_CHECKPOINT_TIME} {at(0).timestamp()}\n"
        f'{contract.METRIC_IN_PLACE_RESTARTS}{{cause="rank 1 (pod 1) exited 137 (SIGKILL)"}} 1.0\n'
        f"{contract.METRIC_IN_PLACE_RESTART_FAILED_AT} {at(26).timestamp()}\n"
    )
    progress = parse_trainer_metrics(text)
    assert progress.restart_failed_at == at(26).timestamp()
    job, _ = step(job, 30, progress)
    record = job["status"]["recoveries"][-1]
    assert (record["reason"], record["detectionSeconds"]) == ("InPlace", 4.0)
    job, _ = step(job, 40, trainer(27, 15, in_place=1, cause="rank 1 (pod 1) exited 137 (SIGKILL)"))
    assert job["status"]["recoveries"][-1]["downtimeSeconds"] == 14.0, "from the failure at 26 s to 40 s"


def test_an_unset_failure_time_gauge_reads_as_unknown_and_a_pod_clock_ahead_is_clamped() -> None:
    assert (
        parse_trainer_metrics(f"{contract.METRIC_IN_PLACE_RESTART_FAILED_AT} 0.0\n").restart_failed_at is None
    )
    job = accounted_job(elastic={"restartInPlace": True})
    job, _ = step(job, 20, trainer(20, 15))
    ahead = TrainerProgress(
        **{**trainer(17, 15, in_place=1, cause="x").__dict__, "restart_failed_at": at(35).timestamp()}
    )
    job, _ = step(job, 30, ahead)
    assert job["status"]["recoveries"][-1]["detectionSeconds"] == 0.0, "never a failure after the pass"


def _progress(step: int, checkpoint: int, checkpoint_time: float, first_step_time: float) -> TrainerProgress:
    return TrainerProgress(
        step=step,
        checkpoint_step=checkpoint,
        checkpoint_time=at(checkpoint_time).timestamp(),
        checkpoints_published=True,
        first_step_time=at(first_step_time).timestamp(),
    )


def test_a_recovery_ends_when_rank_0_stepped_not_when_a_scrape_saw_it() -> None:
    """A SIGKILL at 20 s (the container's finish), the new gang's first step at 27.5 s, seen by
    the operator's scrape at 31 s: 7.5 s down, not 11 (the e2e found the scrape's lag in the
    figure). Its checkpoint (10 s) is older than the failure: the downtime starts at the failure."""
    status = running_status(since=0)
    accounting.start(status, at(0))
    accounting.sample(status, trainer(18, 10), at(18))
    accounting.restarted(
        status,
        reason="WorkerFailed",
        now=at(21),
        failed_at=at(20),
        exit_code=137,
        planned=False,
        size_before=4,
    )
    closed = accounting.sample(status, _progress(12, 10, 10, 27.5), at(31))
    assert closed is not None and closed["downtimeSeconds"] == 7.5


def test_a_planned_stop_is_down_from_the_old_gangs_checkpoint_not_from_the_decision() -> None:
    """kubectl scale decided at 20 s; the old gang trained on and checkpointed step 22 at 22.5 s;
    the new gang stepped at 26 s: 3.5 s down (the old gang's steps after the decision were kept)."""
    status = running_status(since=0)
    accounting.start(status, at(0))
    accounting.sample(status, trainer(20, 15), at(20))
    accounting.restarted(
        status, reason="ScaleDown", now=at(20), failed_at=None, exit_code=None, planned=True, size_before=4
    )
    status["generation"] = 1
    closed = accounting.sample(status, _progress(23, 22, 22.5, 26), at(28))
    assert closed is not None and closed["downtimeSeconds"] == 3.5


def test_steps_redone_count_from_where_the_gang_resumed_even_after_its_next_checkpoint() -> None:
    """Killed at step 13 (checkpoint 10); the operator's first sample of the new gang comes late,
    at step 16, after it checkpointed step 15: it redid 11-13, as rank 0's resumed step says (from
    the newest checkpoint alone the ledger counted 0; the e2e saw it)."""
    status = running_status(since=0)
    accounting.start(status, at(0))
    accounting.sample(status, trainer(13, 10), at(13))
    accounting.restarted(
        status,
        reason="WorkerFailed",
        now=at(14),
        failed_at=at(13),
        exit_code=137,
        planned=False,
        size_before=4,
    )
    status["generation"] = 1  # the new gang (restarts.new_generation)
    late = TrainerProgress(
        step=16,
        checkpoint_step=15,
        checkpoint_time=at(21).timestamp(),
        checkpoints_published=True,
        first_step_time=at(19).timestamp(),
        resumed_step=10,
        resumed_state_time=at(10).timestamp(),
    )
    closed = accounting.sample(status, late, at(23))
    assert status["goodput"]["stepsRedone"] == 3
    assert closed is not None and closed["downtimeSeconds"] == 6.0, (
        "from the kill at 13 s to the step at 19 s"
    )


def test_a_job_without_accounts_gets_no_new_fields_and_a_new_job_starts_them() -> None:
    old = make_job(status=running_status(since=0))
    patch = status_patch(run(old, gang(4), two_nodes(), now=20, progress=trainer(15, 10)))
    assert not {"goodput", "progress", "eta", "recoveries"} & set(patch)
    new = status_patch(run(make_job(), [], two_nodes(), now=3, service_exists=False))
    assert new["goodput"] == {
        "ratio": 0.0,
        "keptSeconds": 0.0,
        "stepsRedone": 0,
        "highestStep": 0,
        "since": to_rfc3339(at(3)),
    }


def test_the_trainer_publishes_the_total_and_the_operator_reads_tokens_and_mfu() -> None:
    text = (
        f"{contract.METRIC_STEP} 7.0\n{contract.METRIC_TOTAL_STEPS} 200.0\n"
        f"{contract.METRIC_TOKENS_PER_SECOND} 512.5\n{contract.METRIC_MFU} 0.25\n"
    )
    seen = parse_trainer_metrics(text)
    assert (seen.step, seen.total_steps, seen.tokens_per_second, seen.mfu) == (7, 200, 512.5, 0.25)
    from dtjob.trainer.metrics import TrainerMetrics

    published = TrainerMetrics().registry
    names = {m.name for m in published.collect()}
    assert {contract.METRIC_TOTAL_STEPS, contract.METRIC_TOKENS_PER_SECOND, contract.METRIC_MFU} <= names


def test_every_per_job_metric_of_the_contract_is_registered_with_its_labels() -> None:
    metrics = OperatorMetrics()
    registered = {m.name: m for m in metrics.registry.collect()}
    for doc in contract.JOB_METRICS:
        family = doc.name.removesuffix("_total")
        assert family in registered, doc.name
        assert registered[family].type == doc.kind


def test_a_failure_during_a_planned_rescale_ends_the_rescale_and_is_its_own_recovery() -> None:
    job = accounted_job()
    job, _ = step(job, 10, trainer(10, 0))
    job, _ = step(job, 30, trainer(30, 30))
    job["spec"]["replicas"] = 2  # kubectl scale at 40: planned, the gang checkpoints at 30
    job, actions = step(job, 40, trainer(30, 30))
    rescale = job["status"]["recoveries"][-1]
    sizes = (rescale["worldSizeBefore"], rescale["worldSizeAfter"])
    assert (rescale["cause"], rescale["stepsRedone"], sizes) == ("PlannedRescale", 0, (4, 2))
    assert rescale["detectionSeconds"] == 0.0
    # generation 1's rank 1 fails at 44 (seen at 45) before the gang stepped
    pods = gang(2, generation=1)
    pods[1] = make_pod(1, generation=1, node="n2", phase="Failed", exit_code=1)
    pods[1]["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = to_rfc3339(at(44))
    job, actions = step(job, 45, trainer(30, 30), pods=pods)
    first, second = job["status"]["recoveries"][-2:]
    assert first["downtimeSeconds"] == 4.0, "the rescale's downtime ends at the failure"
    assert (second["cause"], second["detectionSeconds"], second["stepsRedone"]) == ("ExitCode", 1.0, 0)
    assert [e.reason for e in events(actions) if e.reason == "GangRecovered"] == ["GangRecovered"]
    assert JobRecovered("PlannedRescale", 4.0) in actions
    job, _ = step(job, 50, None, pods=gang(2, generation=2))  # type: ignore[arg-type]
    job, _ = step(job, 60, trainer(30, 30), pods=gang(2, generation=2))
    job, actions = step(job, 70, trainer(40, 30), pods=gang(2, generation=2))
    assert job["status"]["recoveries"][-1]["downtimeSeconds"] == 26.0, "from 44 to 70"
    assert sum(r["downtimeSeconds"] for r in job["status"]["recoveries"]) == 70 - 40
    kept = job["status"]["goodput"]
    assert (kept["stepsRedone"], kept["keptSeconds"]) == (0, 30.0), "20 s to step 30, 10 s for 31..40"


def test_the_pass_runner_publishes_the_written_status_and_forgets_a_deleted_job() -> None:
    from dtjob.operator.passes import JobPassRunner
    from dtjob.operator.settings import OperatorSettings
    from tests.unit.reconciler_fixtures import settle
    from tests.unit.test_operator_at_scale import PlainKube

    class Kube(PlainKube):
        def forget(self, namespace: str, name: str) -> None:
            pass

    metrics, labels = OperatorMetrics(), {"namespace": "ns", "name": "gpt"}
    runner = JobPassRunner(Kube(), metrics, OperatorSettings())  # type: ignore[arg-type]
    runner.trigger("ns", "gpt")  # the job's first pass starts its accounts
    settle(lambda: metrics.registry.get_sample_value("dtjob_job_goodput_ratio", labels) == 0.0)
    runner.forget("ns", "gpt")  # the job was deleted
    assert metrics.registry.get_sample_value("dtjob_job_goodput_ratio", labels) is None


def test_an_agents_last_line_counts_restarts_but_only_the_failure_is_a_recovery() -> None:
    job = accounted_job(elastic={"restartInPlace": True, "maxRestarts": 9})
    pods = gang(4)
    pods[1] = make_pod(1, node="n1", phase="Failed", exit_code=137)
    log = {"gpt-worker-1": contract.in_place_line(2) + "\n"}
    actions = run(job, pods, two_nodes(), now=50, worker_logs=log)
    patch = status_patch(actions)
    assert patch["restarts"] == 3, "2 in place and the failure"
    assert [(r["cause"], r["reason"]) for r in patch["recoveries"]] == [("Signal", "WorkerFailed")]
    assert "GangRecovered" not in [e.reason for e in events(actions)]
