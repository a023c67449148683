"""Cross-field rules in Python (`validate_job`), on the same invalid manifests the e2e test sends
to the real API server (tests/e2e/test_api_e2e.py imports INVALID and base_job from here)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from dtjob.api import parse_job, validate_job
from dtjob.api.rules import RULES, TRANSITION_RULES, name_ok


def base_job(name: str = "valid-job") -> dict[str, Any]:
    """A small valid job, every rule satisfied."""
    return {
        "apiVersion": "training.dtjob.io/v1alpha1",
        "kind": "DistributedTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "elastic": {"minReplicas": 1, "maxReplicas": 3},
            "checkpoint": {"volume": {"emptyDir": {}}, "mountPath": "/ckpt"},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "dtjob/trainer:0.1.0",
                            "command": ["python", "-m", "dtjob.trainer"],
                            "resources": {"requests": {"cpu": "100m"}},
                        }
                    ]
                }
            },
        },
    }


@dataclass(frozen=True)
class Invalid:
    """A way to break `base_job`, and the field(s) the error must name."""

    name: str
    breaks: Callable[[dict[str, Any]], None]
    fields: tuple[str, ...]
    # False: only the API server sees it (inside the Kubernetes PodTemplateSpec / VolumeSource
    # schemas, which the Python models keep as plain dicts).
    python: bool = True


def _spec(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda job: job["spec"].update(changes)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def breaks(job: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = job
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[leaf] = value

    return breaks


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def breaks(job: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = job
        for key in parents:
            node = node[key]
        del node[leaf]

    return breaks


CONTAINER = "spec.template.spec.containers.0"
INVALID: list[Invalid] = [
    Invalid("replicas-zero", _spec(replicas=0), ("spec.replicas",)),
    Invalid("replicas-below-min", _set("spec.elastic.minReplicas", 3), ("spec.replicas", "minReplicas")),
    Invalid("replicas-above-max", _spec(replicas=4), ("spec.replicas", "maxReplicas")),
    Invalid(
        "max-below-min",
        lambda job: job["spec"].update(replicas=2, elastic={"minReplicas": 2, "maxReplicas": 1}),
        ("spec.elastic.maxReplicas",),
    ),
    Invalid("negative-max-restarts", _set("spec.elastic.maxRestarts", -1), ("spec.elastic.maxRestarts",)),
    Invalid("master-port-too-big", _spec(masterPort=70000), ("spec.masterPort",)),
    Invalid("master-port-zero", _spec(masterPort=0), ("spec.masterPort",)),
    Invalid("metrics-port-is-master-port", _spec(masterPort=9400, metricsPort=9400), ("spec.metricsPort",)),
    Invalid("metrics-port-is-agent-port", _spec(masterPort=9400, metricsPort=9401), ("spec.metricsPort",)),
    Invalid("master-port-leaves-no-agent-port", _spec(masterPort=65535), ("spec.masterPort",)),
    Invalid("no-trainer-container", _set(f"{CONTAINER}.name", "worker"), ("spec.template.spec.containers",)),
    Invalid(
        "pod-restart-policy-always",
        _set("spec.template.spec.restartPolicy", "Always"),
        ("spec.template.spec.restartPolicy",),
    ),
    Invalid(
        "misspelt-pod-spec-field",
        lambda job: job["spec"]["template"]["spec"].update(containres=[]),
        ("spec.template.spec.containres",),
        python=False,
    ),
    Invalid(
        "bad-cpu-quantity",
        _set(f"{CONTAINER}.resources.requests.cpu", "2 cores"),
        ("spec.template.spec.containers[0].resources.requests.cpu",),
        python=False,
    ),
    Invalid(
        "misspelt-volume-type",
        _set("spec.checkpoint.volume", {"hostpath": {"path": "/tmp"}}),
        ("spec.checkpoint.volume.hostpath",),
        python=False,
    ),
    Invalid("unknown-spec-field", _spec(replica=3), ("spec.replica",)),
    Invalid("missing-template", _delete("spec.template"), ("spec.template",)),
    Invalid(
        "bad-clean-pod-policy",
        _set("spec.runPolicy.cleanPodPolicy", "Sometimes"),
        ("spec.runPolicy.cleanPodPolicy",),
    ),
    Invalid(
        "bad-restart-policy", _set("spec.elastic.restartPolicy", "Always"), ("spec.elastic.restartPolicy",)
    ),
    Invalid(
        "exit-code-out-of-range",
        _set("spec.elastic.permanentExitCodes", [300]),
        ("spec.elastic.permanentExitCodes",),
    ),
    Invalid("relative-mount-path", _set("spec.checkpoint.mountPath", "ckpt"), ("spec.checkpoint.mountPath",)),
    Invalid("queue-without-gang", _set("spec.scheduling.queue", "research"), ("spec.scheduling.queue",)),
    Invalid("tensor-zero", _spec(nprocPerWorker=2, parallelism={"tensor": 0}), ("spec.parallelism.tensor",)),
    Invalid("parallelism-without-nproc", _spec(parallelism={"tensor": 2}), ("spec.parallelism",)),
    Invalid(
        "tensor-not-dividing-nproc",
        _spec(nprocPerWorker=3, parallelism={"tensor": 2}),
        ("spec.parallelism.tensor", "nprocPerWorker"),
    ),
    Invalid(
        "world-sizes-not-multiples-of-tensor-x-pipeline",
        _spec(nprocPerWorker=2, parallelism={"tensor": 2, "pipeline": 2}),
        ("spec.parallelism", "every world size"),
    ),
    Invalid("name-with-dots", _set("metadata.name", "job.v2"), ("metadata.name",)),
    Invalid("name-too-long", _set("metadata.name", "j" * 51), ("metadata.name",)),
]


def broken(case: Invalid, name: str = "valid-job") -> dict[str, Any]:
    job = base_job(name)
    case.breaks(job)
    return job


def test_the_base_job_is_valid() -> None:
    assert validate_job(base_job()) == []


def test_cases_are_distinct() -> None:
    assert len({c.name for c in INVALID}) == len(INVALID) >= 10
    manifests = [repr(broken(c)) for c in INVALID]
    assert len(set(manifests)) == len(manifests)


@pytest.mark.parametrize("case", [c for c in INVALID if c.python], ids=lambda c: c.name)
def test_validate_job_names_the_field(case: Invalid) -> None:
    problems = validate_job(broken(case))
    assert problems, f"{case.name}: validate_job accepted it"
    assert any(all(f.split("[")[0] in p for f in case.fields) for p in problems), problems


@pytest.mark.parametrize("case", [c for c in INVALID if not c.python], ids=lambda c: c.name)
def test_server_only_cases_pass_python(case: Invalid) -> None:
    # Documents the split: Kubernetes' own schemas inside the template are the API server's job.
    assert validate_job(broken(case)) == []


def test_every_rule_has_a_failing_case() -> None:
    messages = {m for c in INVALID if c.python for m in validate_job(broken(c))}
    for rule in RULES:
        assert f"spec.{rule.field}: {rule.message}" in messages, rule.message


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("spec.masterPort", _spec(masterPort=29501)),
        ("spec.template", _set(f"{CONTAINER}.image", "dtjob/trainer:0.2.0")),
        ("spec.checkpoint", _set("spec.checkpoint.mountPath", "/elsewhere")),
        ("spec.checkpoint", _delete("spec.checkpoint")),
        ("spec.parallelism", _spec(nprocPerWorker=2, parallelism={"tensor": 2})),
        ("spec.parallelism", _spec(nprocPerWorker=2, parallelism={"pipeline": 2})),
    ],
)
def test_immutable_fields(field: str, change: Callable[[dict[str, Any]], None]) -> None:
    old = base_job()
    new = copy.deepcopy(old)
    change(new)
    assert validate_job(new) == []  # fine as a new job
    problems = validate_job(new, old)
    assert any(p.startswith(field + ":") and "immutable" in p for p in problems), problems


def test_mutable_fields_change_freely() -> None:
    old = base_job()
    new = copy.deepcopy(old)
    new["spec"]["replicas"] = 3
    new["spec"]["runPolicy"] = {"suspend": True}
    new["spec"]["elastic"]["maxRestarts"] = 10
    assert validate_job(new, old) == []
    assert len(TRANSITION_RULES) == 4


def test_parallelism_compares_its_sizes_and_names_the_way_to_change_them() -> None:
    """Unset and {tensor: 1, pipeline: 1} are the same sizes; dropping T=2 is a change."""
    old = base_job()
    old["spec"].update(nprocPerWorker=2, parallelism={"tensor": 2})
    same = copy.deepcopy(old)
    same["spec"]["parallelism"] = {"tensor": 2, "pipeline": 1}
    assert validate_job(same, old) == []
    explicit_ones = copy.deepcopy(base_job())
    explicit_ones["spec"]["parallelism"] = {"tensor": 1, "pipeline": 1}
    assert validate_job(explicit_ones, base_job()) == []
    dropped = copy.deepcopy(old)
    del dropped["spec"]["parallelism"]
    problems = validate_job(dropped, old)
    assert len(problems) == 1 and problems[0].startswith("spec.parallelism: parallelism is immutable")
    assert "delete and recreate the job" in problems[0] and "full_state_dict" in problems[0]


def test_validate_job_accepts_a_model() -> None:
    job = parse_job(base_job())
    assert validate_job(job, job) == []


def test_job_names() -> None:
    assert name_ok("fsdp-gpt") and name_ok("a" * 50)
    assert not name_ok("a" * 51) and not name_ok("9lives") and not name_ok("x.y") and not name_ok("end-")
