"""The nodelet's container environment and command line (kubelet semantics)."""

from __future__ import annotations

import pytest

from dtjob.devcluster.nodelet.env import VENV_BIN, EnvError, command_line, container_env, expand, resource_ref

POD = {
    "metadata": {
        "name": "p",
        "namespace": "team",
        "uid": "u-1",
        "labels": {"app": "x"},
        "annotations": {"a": "b"},
    },
    "spec": {"nodeName": "dtjob-node-1", "serviceAccountName": "trainer", "hostname": "h"},
    "status": {"podIP": "10.244.1.2", "hostIP": "10.244.0.1"},
}
API = ("10.244.0.1", "6443")


def _env(container: dict[str, object], **kw: dict[str, dict[str, str]]) -> dict[str, str]:
    return container_env(POD, {"name": "c", **container}, kw.get("cms", {}), kw.get("secrets", {}), API)


def test_field_refs_and_values_with_expansion() -> None:
    env = _env(
        {
            "env": [
                {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                {"name": "ANN", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['a']"}}},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "ADDR", "value": "$(NAME).$(NS):$(MISSING) $$(NAME)"},
            ]
        }
    )
    assert (env["NAME"], env["NS"], env["APP"], env["ANN"]) == ("p", "team", "x", "b")
    assert (env["IP"], env["NODE"]) == ("10.244.1.2", "dtjob-node-1")
    assert env["ADDR"] == "p.team:$(MISSING) $(NAME)"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.244.0.1" and env["KUBERNETES_SERVICE_PORT"] == "6443"
    assert env["PATH"].split(":")[0] == VENV_BIN and env["HOSTNAME"] == "h"


def test_config_map_and_secret_refs() -> None:
    env = _env(
        {
            "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
            "env": [
                {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                {
                    "name": "OPT",
                    "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope", "optional": True}},
                },
            ],
        },
        cms={"cm": {"k": "v"}},
        secrets={"s": {"pw": "hunter2"}},
    )
    assert env["CM_k"] == "v" and env["PW"] == "hunter2" and "OPT" not in env
    with pytest.raises(EnvError, match="'s' key 'gone'"):
        _env(
            {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "gone"}}}]},
            secrets={"s": {}},
        )


def test_unsupported_field_ref_is_a_clear_error() -> None:
    with pytest.raises(EnvError, match=r"fieldPath 'spec\.bogus'"):
        _env({"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.bogus"}}}]})


def test_resource_field_ref_rounds_up_in_divisor_units() -> None:
    c = {"resources": {"limits": {"cpu": "1500m", "memory": "1Gi"}}}
    assert resource_ref(c, {"resource": "limits.cpu"}) == "2"
    assert resource_ref(c, {"resource": "limits.memory", "divisor": "1Mi"}) == "1024"


def test_command_line_expands_and_requires_a_command() -> None:
    env = {"RANK": "3"}
    c = {"name": "c", "command": ["python", "-c"], "args": ["print($(RANK))"]}
    assert command_line(c, env) == ["python", "-c", "print(3)"]
    assert expand("$$", env) == "$"
    with pytest.raises(EnvError, match="has no `command`"):
        command_line({"name": "c", "args": ["x"]}, env)
