"""The DistributedTrainingJob API in a real kube-apiserver: the generated CRD accepts the examples,
rejects bad manifests naming the field, documents itself, scales within bounds and prints columns.

Jobs created here are suspended (`runPolicy.suspend: true`), so an operator running alongside
starts no worker pods for them. The CRD is applied, never deleted (other tests' jobs live in it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dtjob.api import crd, parse_job
from dtjob.api.models import ElasticPolicy
from tests.e2e.conftest import Devcluster, apply_crd, kubectl, kubectl_json
from tests.unit.test_api_validation import INVALID, Invalid, base_job, broken

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CRD_PATH = ROOT / "crds" / crd.CRD_FILE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def namespace(devcluster: Devcluster) -> Iterator[str]:
    """The current CRD installed (server-side apply: it is larger than a client-side apply likes),
    and a namespace of our own for the jobs."""
    apply_crd(CRD_PATH)
    name = f"api-e2e-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", name, check=True)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false")


def _apply(manifest: dict[str, Any], namespace: str, *extra: str) -> Any:
    return kubectl("apply", "-n", namespace, "-f", "-", *extra, input=yaml.safe_dump(manifest))


def _suspended(name: str) -> dict[str, Any]:
    job = base_job(name)
    job["spec"]["runPolicy"] = {"suspend": True}
    return job


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted(namespace: str, path: Path) -> None:
    result = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path))
    assert result.returncode == 0, result.stderr
    assert "(server dry run)" in result.stdout


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.name)
def test_invalid_manifest_is_rejected_naming_the_field(namespace: str, case: Invalid) -> None:
    name = None if case.name.startswith("name-") else f"bad-{case.name}"
    manifest = broken(case) if name is None else broken(case, name)
    result = _apply(manifest, namespace, "--dry-run=server")
    assert result.returncode != 0, f"{case.name} was accepted"
    for field in case.fields:
        assert field in result.stderr, result.stderr


def test_explain_shows_the_model_descriptions(namespace: str) -> None:
    out = kubectl("explain", "dtj.spec.elastic", check=True).stdout
    flat = " ".join(out.split())
    for field_name, field in ElasticPolicy.model_fields.items():
        assert field.alias and field.alias in out, field_name
        assert field.description and " ".join(field.description.split()[:8]) in flat, field_name
    containers = kubectl("explain", "dtj.spec.template.spec.containers", check=True).stdout
    assert "volumeMounts" in containers and "resources" in containers


def test_scale_within_bounds_and_refused_outside(namespace: str) -> None:
    name = "scale-me"  # replicas 2, elastic 1..3
    assert _apply(_suspended(name), namespace).returncode == 0
    target = f"dtj/{name}"
    kubectl("scale", "-n", namespace, target, "--replicas=3", check=True)
    assert kubectl_json("get", "-n", namespace, target)["spec"]["replicas"] == 3
    kubectl("scale", "-n", namespace, target, "--replicas=1", check=True)
    assert kubectl_json("get", "-n", namespace, target)["spec"]["replicas"] == 1
    for refused, bound in ((4, "maxReplicas"), (0, "spec.replicas")):
        result = kubectl("scale", "-n", namespace, target, f"--replicas={refused}")
        assert result.returncode != 0, f"scaling to {refused} was accepted"
        assert "spec.replicas" in result.stderr and bound in result.stderr, result.stderr
    assert kubectl_json("get", "-n", namespace, target)["spec"]["replicas"] == 1


def test_immutable_fields_are_refused_and_the_rest_may_change(namespace: str) -> None:
    name = "immutable"
    assert _apply(_suspended(name), namespace).returncode == 0
    for patch, field in (
        ({"spec": {"masterPort": 29501}}, "spec.masterPort"),
        ({"spec": {"checkpoint": {"mountPath": "/elsewhere"}}}, "spec.checkpoint"),
        ({"spec": {"template": {"metadata": {"labels": {"new": "label"}}}}}, "spec.template"),
    ):
        result = kubectl("patch", "-n", namespace, f"dtj/{name}", "--type=merge", "-p", json.dumps(patch))
        assert result.returncode != 0, f"{patch} was accepted"
        assert field in result.stderr and "immutable" in result.stderr, result.stderr
    allowed = {"spec": {"elastic": {"maxRestarts": 7}, "scheduling": {"priorityClassName": "high"}}}
    kubectl("patch", "-n", namespace, f"dtj/{name}", "--type=merge", "-p", json.dumps(allowed), check=True)


def test_defaults_status_and_columns(namespace: str) -> None:
    name = "columns"
    assert _apply(_suspended(name), namespace).returncode == 0
    stored = kubectl_json("get", "-n", namespace, f"dtj/{name}")
    job = parse_job(stored)  # what the operator reads parses, with the API server's defaults
    assert stored["spec"]["masterPort"] == 29500 and stored["spec"]["elastic"]["maxRestarts"] == 3
    assert job.spec.run_policy.suspend is True

    # The operator's status write, through the status subresource. The patch's own answer is read
    # (an operator running alongside may write its own status right after).
    status = {
        "phase": "Running",
        "replicas": 2,
        "selector": f"training.dtjob.io/job-name={name}",
        "generation": 1,
        "restarts": 0,
        "step": 7,
        "lastCheckpoint": {"step": 5, "time": "2026-01-01T00:00:00Z"},
    }
    patch = ["patch", "-n", namespace, f"dtj/{name}", "--subresource=status", "--type=merge"]
    answer = kubectl(*patch, "-p", json.dumps({"status": status}), "-o", "json", check=True)
    assert parse_job(json.loads(answer.stdout)).status.to_dict() == {**status, "conditions": []}

    header = kubectl("get", "-n", namespace, "dtj", name, check=True).stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "CURRENT", "DESIRED", "STEP", "RESTARTS", "GOODPUT", "ETA", "AGE"]
    wide = kubectl("get", "-n", namespace, "dtj", name, "-o", "wide", check=True).stdout.splitlines()
    assert wide[0].split() == [*header[:-1], "PROCESSES", "GENERATION", "MIN", "MAX", "AGE"]
    row = wide[1].split()  # status columns may be blank; MIN and MAX (spec) sit right before AGE
    assert row[0] == name and row[-3:-1] == ["1", "3"], wide
    everything = kubectl("get", "all", "-n", namespace, "-o", "name", check=True).stdout
    assert f"distributedtrainingjob.training.dtjob.io/{name}" in everything.splitlines()
    path = f"/apis/training.dtjob.io/v1alpha1/namespaces/{namespace}/distributedtrainingjobs/{name}/scale"
    scale = json.loads(kubectl("get", "--raw", path, check=True).stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2
