"""The DistributedTrainingJob models: YAML round-trip, defaults, aliases, parse errors."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from dtjob.api import (
    CleanPodPolicy,
    Condition,
    DistributedTrainingJob,
    InvalidJobError,
    JobPhase,
    RestartPolicy,
    parse_job,
)
from dtjob.api.models import DEFAULT_MASTER_PORT, DEFAULT_METRICS_PORT, DistributedTrainingJobStatus

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))

MINIMAL = """
apiVersion: training.dtjob.io/v1alpha1
kind: DistributedTrainingJob
metadata: {name: tiny, namespace: ml}
spec:
  replicas: 3
  template:
    spec:
      containers:
        - name: trainer
          image: dtjob/trainer:0.1.0
"""


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"ddp.yaml", "fsdp-gpt.yaml", "pipeline.yaml", "volcano-queued.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_round_trips_through_the_models(path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    job = parse_job(manifest)
    dumped = job.to_dict()
    # What the user wrote comes back unchanged; the models only add defaults.
    assert _is_subset(manifest, dumped), f"{path.name}: the model lost or changed a field"
    again = parse_job(yaml.safe_load(yaml.safe_dump(dumped)))
    assert again == job


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_trainer_flags_parse_at_every_allowed_world_size(path: Path) -> None:
    # The trainer's own flag parser (no torch import) must accept the example at every world size
    # the operator may choose, e.g. a global batch that some world size does not divide.
    from dtjob.trainer import config

    spec = parse_job(yaml.safe_load(path.read_text())).spec
    trainer = spec.trainer_container()
    assert trainer is not None and trainer["command"] == ["python", "-m", "dtjob.trainer"]
    for world_size in range(spec.min_world_size, (spec.elastic.max_replicas or spec.replicas) + 1):
        config.parse(trainer.get("args", []), {"WORLD_SIZE": str(world_size), "RANK": "0"})


def test_defaults_of_a_minimal_job() -> None:
    job = parse_job(yaml.safe_load(MINIMAL))
    spec = job.spec
    assert (job.name, job.namespace) == ("tiny", "ml")
    assert spec.master_port == DEFAULT_MASTER_PORT == 29500
    assert spec.metrics_port == DEFAULT_METRICS_PORT
    assert spec.elastic.min_replicas is None and spec.elastic.max_replicas is None
    assert spec.min_world_size == 3  # no minReplicas: the job never shrinks
    assert spec.elastic.max_restarts == 3
    assert spec.elastic.unschedulable_timeout_seconds == 60
    assert spec.elastic.restart_policy is RestartPolicy.EXIT_CODE
    assert spec.elastic.permanent_exit_codes == [2, 126, 127]
    assert spec.checkpoint is None
    assert spec.scheduling.gang is False and spec.scheduling.scheduler_name is None
    assert spec.run_policy.clean_pod_policy is CleanPodPolicy.RUNNING
    assert spec.run_policy.suspend is False
    assert job.status.phase is None and job.status.conditions == []
    trainer = spec.trainer_container()
    assert trainer is not None and trainer["image"] == "dtjob/trainer:0.1.0"


def test_dump_uses_camel_case_and_leaves_out_unset_fields() -> None:
    dumped = parse_job(yaml.safe_load(MINIMAL)).to_dict()
    assert dumped["apiVersion"] == "training.dtjob.io/v1alpha1"
    assert dumped["spec"]["masterPort"] == 29500
    assert dumped["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    assert "minReplicas" not in dumped["spec"]["elastic"]
    assert "checkpoint" not in dumped["spec"]


def test_checkpoint_mount_path_default() -> None:
    manifest = yaml.safe_load(MINIMAL)
    manifest["spec"]["checkpoint"] = {"volume": {"emptyDir": {}}}
    assert parse_job(manifest).spec.checkpoint is not None
    assert parse_job(manifest).spec.checkpoint.mount_path == "/checkpoints"  # type: ignore[union-attr]


def test_status_round_trip_as_the_operator_writes_it() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    status = DistributedTrainingJobStatus(
        phase=JobPhase.RUNNING,
        conditions=[Condition(type="Running", status="True", reason="GangRunning", last_transition_time=now)],
        replicas=3,
        selector="training.dtjob.io/job-name=tiny",
        generation=2,
        restarts=1,
        step=40,
        last_checkpoint={"step": 40, "time": now},  # type: ignore[arg-type]
        start_time=now,
    )
    wire = status.to_dict()
    assert wire["phase"] == "Running"
    assert wire["lastCheckpoint"] == {"step": 40, "time": "2026-01-02T03:04:05Z"}
    assert wire["conditions"][0]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert "completionTime" not in wire
    manifest = yaml.safe_load(MINIMAL)
    manifest["status"] = wire
    assert parse_job(manifest).status == status


def test_enum_values_are_the_wire_strings() -> None:
    assert [p.value for p in JobPhase] == [
        "Pending",
        "Running",
        "Restarting",
        "Suspended",
        "Succeeded",
        "Failed",
    ]
    assert JobPhase("Failed") is JobPhase.FAILED


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"replicas": 0}, "spec.replicas"),
        ({"masterPort": 70000}, "spec.masterPort"),
        ({"elastic": {"maxRestarts": -1}}, "spec.elastic.maxRestarts"),
        ({"runPolicy": {"cleanPodPolicy": "Sometimes"}}, "spec.runPolicy.cleanPodPolicy"),
        ({"replica": 2}, "spec.replica"),
    ],
)
def test_parse_errors_name_the_field(change: dict[str, Any], field: str) -> None:
    manifest = yaml.safe_load(MINIMAL)
    manifest["spec"].update(change)
    with pytest.raises(InvalidJobError) as caught:
        parse_job(manifest)
    assert any(e.startswith(field + ":") for e in caught.value.errors), caught.value.errors
    assert field in str(caught.value)


def test_python_names_construct_the_model_too() -> None:
    manifest = yaml.safe_load(MINIMAL)
    job = DistributedTrainingJob.model_validate(manifest)
    rebuilt = job.model_copy(update={"spec": job.spec.model_copy(update={"replicas": 5})})
    assert rebuilt.to_dict()["spec"]["replicas"] == 5


def _is_subset(small: Any, big: Any) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _is_subset(v, big[k]) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(small) == len(big) and all(map(_is_subset, small, big))
    return bool(small == big)
