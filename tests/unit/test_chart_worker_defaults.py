"""The chart's `workers.*` values reach the worker pods: the Deployment's environment, read by
`dtjob operator` (worker_defaults.from_env), fills what a job's template leaves unset."""

from __future__ import annotations

from typing import Any

import pytest

from dtjob.operator import worker_defaults
from dtjob.operator.jobview import JobView
from dtjob.operator.manifests import worker_pod
from tests.unit.test_chart import notes_job_manifest, operator_container, render


def operator_env(*values: str) -> dict[str, str]:
    return {e["name"]: e["value"] for e in operator_container(render(*values))["env"] if "value" in e}


def first_job(template_spec_extra: dict[str, Any] | None = None) -> JobView:
    job = notes_job_manifest("0.1.0")
    job["metadata"].update({"namespace": "team-a", "uid": "1234"})
    job["spec"]["template"]["spec"].update(template_spec_extra or {})
    return JobView(job)


def test_chart_worker_values_fill_the_worker_pod() -> None:
    env = operator_env(
        "--set", "watchNamespaces={team-a}", "--set", "workers.podSecurityContext.fsGroup=2000"
    )
    defaults = worker_defaults.from_env(env)
    pod = worker_pod(first_job(), rank=0, world_size=2, generation=0, defaults=defaults)["spec"]
    assert pod["serviceAccountName"] == "rel-dtjob-worker"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "fsGroup": 2000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    (trainer,) = pod["containers"]
    assert trainer["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def test_the_job_template_wins_over_the_chart() -> None:
    defaults = worker_defaults.from_env(operator_env("--set", "watchNamespaces={team-a}"))
    own = {
        "serviceAccountName": "needs-s3",
        "automountServiceAccountToken": True,
        "securityContext": {"runAsUser": 4242, "seccompProfile": {"type": "Unconfined"}},
    }
    pod = worker_pod(first_job(own), rank=1, world_size=2, generation=3, defaults=defaults)["spec"]
    assert pod["serviceAccountName"] == "needs-s3"
    assert pod["automountServiceAccountToken"] is True
    assert pod["securityContext"]["runAsUser"] == 4242
    assert pod["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert pod["securityContext"]["runAsNonRoot"] is True  # filled by the chart's default


def test_all_namespaces_install_names_no_worker_service_account() -> None:
    defaults = worker_defaults.from_env(operator_env())
    pod = worker_pod(first_job(), rank=0, world_size=1, generation=0, defaults=defaults)["spec"]
    assert "serviceAccountName" not in pod
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (worker_defaults.ENV_POD_SECURITY_CONTEXT, "{runAsUser: 1}", "is not JSON"),
        (worker_defaults.ENV_SECURITY_CONTEXT, "[1]", "must be a JSON object, got list"),
        (worker_defaults.ENV_AUTOMOUNT, "yes", "must be true or false"),
    ],
)
def test_malformed_environment_is_refused_naming_the_variable(name: str, value: str, message: str) -> None:
    with pytest.raises(worker_defaults.WorkerDefaultsError) as error:
        worker_defaults.from_env({name: value})
    assert name in str(error.value) and message in str(error.value)


def test_no_environment_changes_nothing() -> None:
    spec: dict[str, Any] = {"containers": [{"name": "trainer"}]}
    worker_defaults.from_env({}).apply(spec)
    assert spec == {"containers": [{"name": "trainer"}]}
