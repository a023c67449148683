"""The nodelet against the real devcluster (issue 2, tests 1-7): pods run as local processes in
their own network and mount namespaces, with cluster DNS, volumes, service-account tokens, logs,
graceful deletion and node loss."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Devcluster, dtjob_devcluster, kubectl, kubectl_json, wait_for

pytestmark = pytest.mark.e2e

# Pods start within seconds, but this 2-core machine is shared with builds and other tests.
POD_TIMEOUT = 120.0
IMAGE = "python:3.11"  # never pulled: the nodelet runs commands with the checkout's Python


@pytest.fixture(scope="module")
def ns(devcluster: Devcluster) -> Iterator[str]:
    name = f"nodelet-e2e-{secrets.token_hex(3)}"
    kubectl("create", "namespace", name, check=True)
    yield name
    kubectl("delete", "namespace", name, "--wait=false")


def apply(*objs: dict[str, Any]) -> None:
    kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}),
        check=True,
    )


def pod(ns: str, name: str, code: str, restart: str = "Never", **spec: Any) -> dict[str, Any]:
    """A pod whose one container runs a Python program."""
    container = {"name": "main", "image": IMAGE, "command": ["python", "-c", code]}
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": spec.pop("labels", {})},
        "spec": {"restartPolicy": restart, "containers": [container], **spec},
    }


def on_node(i: int) -> dict[str, str]:
    return {"kubernetes.io/hostname": f"dtjob-node-{i}"}


def get_pod(ns: str, name: str) -> dict[str, Any] | None:
    """The pod, or None if it does not exist (any other kubectl failure fails the test)."""
    result = kubectl("get", "pod", name, "-n", ns, "-o", "json")
    if result.returncode != 0 and "NotFound" in result.stderr:
        return None
    if result.returncode != 0:
        pytest.fail(f"kubectl get pod {name}: {result.stderr.strip()}")
    return dict(json.loads(result.stdout))


def phase(ns: str, name: str) -> str | None:
    p = get_pod(ns, name)
    return None if p is None else p.get("status", {}).get("phase")


def wait_phase(ns: str, name: str, *phases: str) -> dict[str, Any]:
    wait_for(
        f"pod {name} to reach {'/'.join(phases)}", lambda: phase(ns, name) in phases, timeout=POD_TIMEOUT
    )
    p = get_pod(ns, name)
    assert p is not None
    return p


def logs(ns: str, name: str) -> str:
    return kubectl("logs", name, "-n", ns, check=True).stdout


def node_ready(name: str) -> str:
    node = kubectl_json("get", "node", name)
    return next(c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready")


def test_python_one_liner_succeeds_and_logs_are_served(ns: str) -> None:
    code = (
        "import socket, sys; print('hello from', socket.gethostname(), 'venv', sys.prefix != sys.base_prefix)"
    )
    apply(pod(ns, "hello", code))
    p = wait_phase(ns, "hello", "Succeeded", "Failed")
    assert p["status"]["phase"] == "Succeeded"
    terminated = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    assert p["status"]["podIP"].startswith("10.244.")
    # The pod's own hostname, and `python` is the checkout's virtual environment.
    assert logs(ns, "hello").split() == ["hello", "from", "hello", "venv", "True"]


def test_exit_code_three_fails_the_pod(ns: str) -> None:
    apply(pod(ns, "exit3", "import sys; print('bye'); sys.exit(3)"))
    p = wait_phase(ns, "exit3", "Succeeded", "Failed")
    assert p["status"]["phase"] == "Failed"
    terminated = p["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")


SERVER = """
import socket
s = socket.create_server(("0.0.0.0", 7000))
conn, _ = s.accept()
data = conn.recv(100)
conn.sendall(b"pong:" + data)
print("server got", data.decode(), flush=True)
"""

CLIENT = """
import socket, time
def retry(attempt):
    for _ in range(240):  # the names appear once the endpoints controller has seen the pods
        try:
            return attempt()
        except OSError:
            time.sleep(0.5)
    raise SystemExit("gave up")
conn = retry(lambda: socket.create_connection(("server.pair.{ns}.svc", 7000), timeout=2))
conn.sendall(b"ping from " + socket.gethostname().encode())
print("client got", conn.recv(100).decode(), flush=True)
ips = retry(lambda: set(a[4][0] for a in socket.getaddrinfo("pair", 7000, socket.AF_INET)))
print("service name resolves:", len(ips) > 0, flush=True)
"""


def test_pods_under_a_headless_service_talk_over_tcp_by_dns_name(ns: str) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "pair", "namespace": ns},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": "pair"},
            "ports": [{"port": 7000}],
        },
    }
    # On two different nodes, so the traffic crosses the bridge between two network namespaces.
    member: dict[str, Any] = {"labels": {"app": "pair"}, "subdomain": "pair"}
    server = pod(ns, "server", SERVER, hostname="server", nodeSelector=on_node(1), **member)
    client = pod(ns, "client", CLIENT.format(ns=ns), hostname="client", nodeSelector=on_node(2), **member)
    apply(service, server, client)
    for name in ("server", "client"):
        assert wait_phase(ns, name, "Succeeded", "Failed")["status"]["phase"] == "Succeeded", logs(ns, name)
    assert logs(ns, "server").strip() == "server got ping from client"
    assert logs(ns, "client").splitlines() == [
        "client got pong:ping from client",
        "service name resolves: True",
    ]


def test_gpu_requests_are_scheduled_only_where_they_fit(ns: str) -> None:
    def gpus(n: int) -> dict[str, Any]:
        return {"resources": {"limits": {"nvidia.com/gpu": str(n)}}}

    apply(
        pod(ns, "gpu-too-many", "print('never')", container=gpus(3)),
        pod(ns, "gpu-two", "print('ok')", container=gpus(2)),
    )
    p = wait_phase(ns, "gpu-two", "Succeeded", "Failed")
    assert p["status"]["phase"] == "Succeeded"
    node = kubectl_json("get", "node", p["spec"]["nodeName"])
    assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) >= 2

    def unschedulable() -> bool:
        conds = (get_pod(ns, "gpu-too-many") or {}).get("status", {}).get("conditions", [])
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds)

    wait_for("the 3-GPU pod to be Unschedulable", unschedulable, timeout=POD_TIMEOUT)
    too_many = get_pod(ns, "gpu-too-many")
    assert too_many is not None and too_many["status"]["phase"] == "Pending"
    assert not too_many["spec"].get("nodeName")


TERM_HANDLER = """
import signal, sys, time
def on_term(signum, frame):
    open("/out/signal", "w").write("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("handler installed", flush=True)
time.sleep(3600)
"""


def test_deleting_a_running_pod_delivers_sigterm_and_removes_it(ns: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    mount = {"volumeMounts": [{"name": "out", "mountPath": "/out"}]}
    volume = {"name": "out", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}}
    apply(
        pod(ns, "graceful", TERM_HANDLER, terminationGracePeriodSeconds=20, container=mount, volumes=[volume])
    )
    wait_phase(ns, "graceful", "Running")
    wait_for("the SIGTERM handler", lambda: "handler installed" in logs(ns, "graceful"), timeout=POD_TIMEOUT)
    kubectl("delete", "pod", "graceful", "-n", ns, "--wait=false", check=True)
    wait_for("the pod object to disappear", lambda: get_pod(ns, "graceful") is None, timeout=POD_TIMEOUT)
    assert (out / "signal").read_text() == "SIGTERM"


SA_CLIENT = """
import os, ssl, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
ctx = ssl.create_default_context(cafile=sa + "ca.crt")
base = "https://%s:%s" % (os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
ns, token = open(sa + "namespace").read(), open(sa + "token").read()
for kind in ("pods", "secrets"):
    url, auth = f"{base}/api/v1/namespaces/{ns}/{kind}", {"Authorization": "Bearer " + token}
    req = urllib.request.Request(url, headers=auth)
    try:
        print(kind, urllib.request.urlopen(req, context=ctx).status)
    except urllib.error.HTTPError as e:
        print(kind, e.code)
"""


def test_service_account_token_grants_exactly_what_rbac_allows(ns: str) -> None:
    rbac = "rbac.authorization.k8s.io/v1"
    apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "lister", "namespace": ns}},
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": {"name": "list-pods", "namespace": ns},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
        },
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": "lister", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "list-pods"},
            "subjects": [{"kind": "ServiceAccount", "name": "lister", "namespace": ns}],
        },
    )
    apply(pod(ns, "sa-client", SA_CLIENT, serviceAccountName="lister"))
    p = wait_phase(ns, "sa-client", "Succeeded", "Failed")
    assert p["status"]["phase"] == "Succeeded", logs(ns, "sa-client")
    assert logs(ns, "sa-client").splitlines() == ["pods 200", "secrets 403"]


@pytest.mark.slow
def test_node_stop_loses_the_node_and_node_start_brings_it_back(ns: str) -> None:
    node = "dtjob-node-3"
    sleeper = "import time; print('up', flush=True); time.sleep(3600)"
    apply(pod(ns, "on-lost-node", sleeper, restart="Always", nodeSelector={"kubernetes.io/hostname": node}))
    wait_phase(ns, "on-lost-node", "Running")
    stop = dtjob_devcluster("node", "stop", node, timeout=120)
    assert stop.returncode == 0, stop.stderr
    try:
        wait_for(f"{node} to be NotReady", lambda: node_ready(node) != "True", timeout=120)

        def failed_or_evicted() -> bool:
            p = get_pod(ns, "on-lost-node")
            return (
                p is None
                or p["status"].get("phase") == "Failed"
                or bool(p["metadata"].get("deletionTimestamp"))
            )

        wait_for("the lost node's pod to be failed or evicted", failed_or_evicted, timeout=120)
    finally:
        start = dtjob_devcluster("node", "start", node, timeout=300)
    assert start.returncode == 0, start.stderr
    wait_for(f"{node} to be Ready again", lambda: node_ready(node) == "True", timeout=120)

    def untainted() -> bool:
        taints = kubectl_json("get", "node", node)["spec"].get("taints") or []
        return not any(t["effect"] in ("NoSchedule", "NoExecute") for t in taints)

    wait_for(f"{node}'s not-ready taints to be removed", untainted, timeout=120)
    # The returned node finishes off the evicted pod and runs new ones.
    wait_for(
        "the evicted pod to be removed or failed",
        lambda: phase(ns, "on-lost-node") in (None, "Failed"),
        timeout=120,
    )
    apply(pod(ns, "after-return", "print('back')", nodeSelector={"kubernetes.io/hostname": node}))
    assert wait_phase(ns, "after-return", "Succeeded", "Failed")["status"]["phase"] == "Succeeded"
    assert logs(ns, "after-return").strip() == "back"
