"""How a failed pass is described on the job: one short line naming what failed and why."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes.client import V1Pod
from kubernetes.client.rest import ApiException
from pydantic import TypeAdapter, ValidationError

from dtjob.operator.actions import CreatePod, DeletePod, PatchStatus
from dtjob.operator.passes import MESSAGE_LIMIT, _short, describe_error
from dtjob.operator.writer import ActionFailed


def refused_by_the_client(manifest: dict[str, Any]) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        TypeAdapter(V1Pod).validate_python(manifest)
    return caught.value


def api_error(status: int, reason: str, message: str) -> ApiException:
    error = ApiException(status=status, reason=reason)
    error.body = json.dumps({"kind": "Status", "message": message})
    return error


def test_a_pod_the_client_refuses_names_the_pod_the_field_and_the_value() -> None:
    trainer = {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 1}}}
    pod = {"metadata": {"name": "gpt-worker-0"}, "spec": {"containers": [trainer]}}
    text = describe_error(ActionFailed(CreatePod(pod), refused_by_the_client(pod)), "act")
    assert text == (
        "creating pod gpt-worker-0: the kubernetes client refused V1Pod "
        "spec.containers.0.resources.limits.nvidia.com/gpu: Input should be a valid string (got 1)"
    )


def test_an_api_error_gives_status_reason_and_the_server_message() -> None:
    error = api_error(403, "Forbidden", 'pods "gpt-worker-1" is forbidden: exceeded quota: pods=0')
    assert describe_error(ActionFailed(DeletePod("gpt-worker-1", "x"), error), "act") == (
        'deleting pod gpt-worker-1: 403 Forbidden: pods "gpt-worker-1" is forbidden: exceeded quota: pods=0'
    )
    assert describe_error(ActionFailed(PatchStatus({}), api_error(422, "Unprocessable", "bad")), "act") == (
        "writing the job's status: 422 Unprocessable: bad"
    )


def test_errors_outside_actions_name_the_stage_and_keep_one_line() -> None:
    error = ValueError("invalid resource quantity 'lots'\nsecond line")
    assert (
        describe_error(error, "decide") == "deciding what to do: ValueError: invalid resource quantity 'lots'"
    )
    assert describe_error(api_error(500, "Internal", "etcd down"), "observe") == (
        "observing the job: 500 Internal: etcd down"
    )


def test_long_messages_are_cut() -> None:
    assert len(_short("x" * 5000)) == MESSAGE_LIMIT and _short("short") == "short"
