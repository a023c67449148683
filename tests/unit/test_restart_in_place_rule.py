"""Restarts in place on or off by one explicit rule (dtjob.operator.in_place), and the job's
condition RestartInPlace saying which and why: an image whose ENTRYPOINT runs the trainer (no
`command`) restarts in place when asked, and is never silently left without."""

from __future__ import annotations

from typing import Any

import pytest

from dtjob.operator import in_place
from dtjob.operator.jobview import JobView
from dtjob.operator.manifests import worker_pod
from dtjob.operator.worker_defaults import WorkerDefaults
from tests.unit.reconciler_fixtures import env_of, make_job, run, status_patch, two_nodes

LAUNCHER = ["python", "-m", "dtjob.launcher", "--"]


def _entrypoint_job(restart_in_place: bool | None, **elastic: Any) -> dict[str, Any]:
    """A job on an image whose ENTRYPOINT is the trainer: the container gives args, no command."""
    extra = {} if restart_in_place is None else {"restartInPlace": restart_in_place}
    job = make_job(elastic={**extra, **elastic})
    container = job["spec"]["template"]["spec"]["containers"][0]
    del container["command"]
    container["args"] = ["--model", "mlp"]
    return job


def _condition(actions: list[Any]) -> dict[str, Any]:
    conditions = status_patch(actions)["conditions"]
    found = [c for c in conditions if c["type"] == in_place.CONDITION]
    assert len(found) == 1, conditions
    return dict(found[0])


def _first_pass(job: dict[str, Any]) -> list[Any]:
    return run(job, pods=[], nodes=two_nodes(), service_exists=True, now=1)


def test_an_entrypoint_trainer_restarts_in_place_when_asked() -> None:
    job = _entrypoint_job(True)
    pod = worker_pod(
        JobView(job), rank=1, world_size=2, generation=0, defaults=WorkerDefaults(), restarts_left=3
    )
    container = pod["spec"]["containers"][0]
    assert container["command"] == [*LAUNCHER, "python", "-m", "dtjob.trainer", "--model", "mlp"]
    assert "args" not in container
    env = env_of(pod)
    assert (env["DTJOB_AGENT_PORT"], env["DTJOB_RESTARTS_LEFT"]) == ("29501", "3")
    condition = _condition(_first_pass(job))
    assert (condition["status"], condition["reason"]) == ("True", "Requested")
    assert "python -m dtjob.trainer (no command given)" in condition["message"]


def test_an_entrypoint_trainer_left_unset_is_off_and_the_condition_says_why() -> None:
    job = _entrypoint_job(None)
    container = worker_pod(JobView(job), 0, 2, 0, WorkerDefaults())["spec"]["containers"][0]
    assert "command" not in container, "the image's ENTRYPOINT runs as it is"
    assert "DTJOB_AGENT_PORT" not in env_of(worker_pod(JobView(job), 0, 2, 0, WorkerDefaults()))
    condition = _condition(_first_pass(job))
    assert (condition["status"], condition["reason"]) == ("False", "NoCommand")
    assert "ENTRYPOINT" in condition["message"] and "restartInPlace: true" in condition["message"]


@pytest.mark.parametrize(
    ("elastic", "command", "on", "reason"),
    [
        ({}, ["python", "-m", "dtjob.trainer", "--steps", "5"], True, "DtjobTrainer"),
        ({}, ["/usr/bin/python3.11", "-u", "-m", "dtjob.trainer"], True, "DtjobTrainer"),
        ({}, ["python", "/script/train.py"], False, "OtherCommand"),
        ({"restartInPlace": True}, ["python", "/script/train.py"], True, "Requested"),
        ({"restartInPlace": False}, ["python", "-m", "dtjob.trainer"], False, "NotRequested"),
        ({"restartInPlace": True, "restartPolicy": "Never"}, ["python", "-m", "dtjob.trainer"], False,
         "RestartPolicyNever"),
    ],
)  # fmt: skip
def test_the_rule_and_its_reasons(elastic: dict[str, Any], command: list[str], on: bool, reason: str) -> None:
    job = make_job(elastic=elastic)
    job["spec"]["template"]["spec"]["containers"][0]["command"] = command
    rule = JobView(job).restart_in_place_rule
    assert (rule.on, rule.reason) == (on, reason)
    assert JobView(job).restart_in_place is on
    condition = _condition(_first_pass(job))
    assert (condition["status"], condition["reason"], condition["message"]) == (str(on), reason, rule.message)
    has_agent = "DTJOB_AGENT_PORT" in env_of(worker_pod(JobView(job), 0, 2, 0, WorkerDefaults()))
    assert has_agent is on


def test_the_condition_follows_a_spec_change_once_set() -> None:
    job = _entrypoint_job(None)
    first = _first_pass(job)
    job["status"] = {**status_patch(first), "conditions": status_patch(first)["conditions"]}
    job["spec"]["elastic"]["restartInPlace"] = True
    later = run(job, pods=[], nodes=two_nodes(), service_exists=True, now=2)
    condition = _condition(later)
    assert (condition["status"], condition["reason"]) == ("True", "Requested")
