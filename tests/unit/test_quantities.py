"""Quantities in every form the API server accepts (a number, "2", "500m", "1Gi") work in every
field the operator copies into a pod or computes with."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from kubernetes.client import V1Pod
from pydantic import TypeAdapter

from dtjob.operator.capacity import workers_that_fit
from dtjob.operator.jobview import JobView
from dtjob.operator.manifests import podgroup, worker_pod
from dtjob.operator.quantity import format_quantity, parse_quantity, quantity_string, stringify_quantities
from dtjob.operator.worker_defaults import WorkerDefaults
from tests.unit.reconciler_fixtures import make_job, make_node

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# What the kubernetes client checks a pod body against before it sends it (create_namespaced_pod).
CLIENT_POD = TypeAdapter(V1Pod)


def pod_of(job: dict[str, Any]) -> dict[str, Any]:
    job.setdefault("metadata", {}).update(namespace="ml", uid="u")
    return worker_pod(JobView(job), rank=0, world_size=4, generation=0, defaults=WorkerDefaults())


def test_the_volcano_example_with_an_integer_gpu_count_makes_a_pod_the_client_accepts() -> None:
    # `nvidia.com/gpu: 1` is how most users write it; the client refused it ("Input should be a
    # valid string") and the job stayed Pending without a word.
    job = yaml.safe_load((EXAMPLES / "volcano-queued.yaml").read_text())
    pod = pod_of(job)
    CLIENT_POD.validate_python(pod)
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources == {
        "requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }


def test_numbers_in_every_quantity_field_of_a_pod_become_strings() -> None:
    job = make_job(cpu=2)
    job["spec"]["checkpoint"]["volume"] = {"emptyDir": {"sizeLimit": 1073741824}}
    spec = job["spec"]["template"]["spec"]
    trainer = spec["containers"][0]
    trainer["resources"]["limits"] = {"cpu": 2, "memory": "4Gi", "nvidia.com/gpu": 1}
    trainer["env"].append(
        {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu", "divisor": 1}}}
    )
    spec["initContainers"] = [{"name": "fetch", "image": "busybox", "resources": {"requests": {"cpu": 0.5}}}]
    spec["resources"] = {"limits": {"cpu": 4, "memory": "8Gi"}}
    spec["overhead"] = {"cpu": 0.25}
    spec["volumes"] = [
        {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": 512}},
        {
            "name": "claim",
            "ephemeral": {
                "volumeClaimTemplate": {
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": 10}}}
                }
            },
        },
        {
            "name": "info",
            "downwardAPI": {
                "items": [
                    {
                        "path": "cpu",
                        "resourceFieldRef": {
                            "containerName": "trainer",
                            "resource": "requests.cpu",
                            "divisor": 1,
                        },
                    }
                ]
            },
        },
    ]
    pod = pod_of(job)
    CLIENT_POD.validate_python(pod)
    out = pod["spec"]
    assert out["containers"][0]["resources"] == {
        "requests": {"cpu": "2"},
        "limits": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"},
    }
    divisor = next(e for e in out["containers"][0]["env"] if e["name"] == "CPUS")["valueFrom"]
    assert divisor["resourceFieldRef"]["divisor"] == "1"
    assert out["initContainers"][0]["resources"]["requests"]["cpu"] == "0.5"
    assert out["resources"]["limits"]["cpu"] == "4" and out["overhead"] == {"cpu": "0.25"}
    volumes = {v["name"]: v for v in out["volumes"]}
    assert volumes["scratch"]["emptyDir"]["sizeLimit"] == "512"
    claim = volumes["claim"]["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"]
    assert claim == {"storage": "10"}
    assert volumes["info"]["downwardAPI"]["items"][0]["resourceFieldRef"]["divisor"] == "1"
    assert volumes["checkpoint"]["emptyDir"]["sizeLimit"] == "1073741824"


def test_integers_elsewhere_stay_integers() -> None:
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 30,
        "containers": [
            {
                "name": "t",
                "ports": [{"containerPort": 9400}],
                "livenessProbe": {"httpGet": {"port": 8080}, "periodSeconds": 5},
            }
        ],
    }
    assert stringify_quantities(spec) == {
        "terminationGracePeriodSeconds": 30,
        "containers": [
            {
                "name": "t",
                "ports": [{"containerPort": 9400}],
                "livenessProbe": {"httpGet": {"port": 8080}, "periodSeconds": 5},
            }
        ],
    }


def test_capacity_and_the_podgroup_compute_with_numbers_as_with_strings() -> None:
    as_numbers = make_job(cpu=1)
    as_numbers["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": 1}
    as_strings = make_job(cpu="1000m")
    as_strings["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "1"}
    node = make_node("g1", cpu="8")
    node["status"]["allocatable"]["nvidia.com/gpu"] = 2  # a node object written by hand
    for job in (as_numbers, as_strings):
        assert workers_that_fit("gpt", job["spec"]["template"], [node], []) == 2
        assert podgroup(JobView(job), 3)["spec"]["minResources"] == {"cpu": "3", "nvidia.com/gpu": "3"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, Decimal(1)),
        (0.5, Decimal("0.5")),
        ("500m", Decimal("0.5")),
        ("1Gi", Decimal(2**30)),
        ("1e3", Decimal(1000)),
        ("1E", Decimal(10**18)),
        ("+2", Decimal(2)),
        (".5", Decimal("0.5")),
    ],
)
def test_every_form_parses(value: object, expected: Decimal) -> None:
    assert parse_quantity(value) == expected


@pytest.mark.parametrize("value", [True, "lots", "1e", None])
def test_a_bad_quantity_names_the_value(value: object) -> None:
    with pytest.raises(ValueError, match="invalid resource quantity"):
        parse_quantity(value)


@given(st.integers(min_value=0, max_value=10**15) | st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_a_number_and_its_quantity_string_are_the_same_quantity(value: int | float) -> None:
    text = quantity_string(value)
    assert isinstance(text, str) and parse_quantity(text) == Decimal(
        repr(value) if isinstance(value, float) else value
    )


@given(st.integers(min_value=0, max_value=10**6))
def test_format_quantity_round_trips_milli_units(millis: int) -> None:
    value = Decimal(millis) / 1000
    assert parse_quantity(format_quantity(value)) == value
