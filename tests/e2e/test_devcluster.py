"""The devcluster itself: control plane health, versions, nodes, the CLI, and a clean `down`."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from dtjob.devcluster.binaries import K8S_TOOLS
from dtjob.devcluster.layout import BRIDGE, CONTROL_PLANE
from tests.e2e.conftest import (
    Devcluster,
    dtjob_devcluster,
    helm,
    host_resources,
    kubectl,
    kubectl_json,
    other_live_sessions,
    wait_for,
)

pytestmark = pytest.mark.e2e

NODES = [f"dtjob-node-{i}" for i in (1, 2, 3)]


def test_control_plane_answers_readyz_and_every_check_passes(devcluster: Devcluster) -> None:
    assert kubectl("get", "--raw", "/readyz", check=True).stdout.strip() == "ok"
    verbose = kubectl("get", "--raw", "/readyz?verbose", check=True).stdout
    assert "readyz check passed" in verbose
    assert "[+]etcd ok" in verbose


def test_versions_are_the_pinned_ones(devcluster: Devcluster) -> None:
    versions = json.loads(kubectl("version", "-o", "json", check=True).stdout)
    assert versions["clientVersion"]["gitVersion"] == "v1.37.2"
    assert versions["serverVersion"]["gitVersion"] == "v1.37.2"
    assert helm("version", "--short", check=True).stdout.startswith("v3.22.0")
    etcd = subprocess.run(
        [str(devcluster.binaries.path("etcd")), "--version"], capture_output=True, text=True
    )
    assert "etcd Version: 3.7.3" in etcd.stdout


def test_nodes_are_ready_with_gpu_capacity(devcluster: Devcluster) -> None:
    items = {n["metadata"]["name"]: n for n in kubectl_json("get", "nodes")["items"]}
    assert sorted(items) == NODES
    for name, node in items.items():
        conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conditions.get("Ready") == "True", f"{name}: {conditions}"
        capacity = node["status"]["capacity"]
        assert capacity["nvidia.com/gpu"] == "2", name
        assert capacity["cpu"] == "4", name
        assert capacity["memory"] == "8Gi", name


def test_controllers_run_as_their_own_service_accounts(devcluster: Devcluster) -> None:
    # --use-service-account-credentials: the controller manager creates one ServiceAccount per
    # controller, and the default ServiceAccount of every namespace exists before `up` returns.
    accounts = kubectl("get", "serviceaccounts", "-n", "kube-system", "-o", "name", check=True).stdout.split()
    assert "serviceaccount/generic-garbage-collector" in accounts
    assert "serviceaccount/node-controller" in accounts
    assert "serviceaccount/endpointslice-controller" in accounts
    kubectl("get", "serviceaccount", "default", "-n", "default", check=True)


def test_nodes_are_authorized_by_the_node_authorizer_and_rbac(devcluster: Devcluster) -> None:
    def can(verb: str, resource: str) -> str:
        as_node = ("--as", "system:node:dtjob-node-1", "--as-group", "system:nodes")
        return kubectl("auth", "can-i", verb, resource, "-A", *as_node).stdout.split(" ")[0].strip()

    assert can("list", "endpointslices.discovery.k8s.io") == "yes"  # the nodelet-dns binding `up` applies
    assert can("list", "secrets") == "no"  # the Node authorizer grants only secrets its pods use


def test_status_lists_every_component_and_node_as_healthy(devcluster: Devcluster) -> None:
    result = dtjob_devcluster("status", timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()[1:]}
    for name in [*CONTROL_PLANE, *NODES]:
        pid, alive, healthy = rows[name]
        assert int(pid) > 0 and Path(f"/proc/{pid}").exists(), name
        assert (alive, healthy) == ("yes", "yes"), name


def test_env_output_makes_kubectl_and_helm_talk_to_the_cluster(devcluster: Devcluster) -> None:
    result = dtjob_devcluster("env", timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"export KUBECONFIG={devcluster.kubeconfig}" in result.stdout.splitlines()
    # A clean shell with no KUBECONFIG and only the system PATH, as a user would have.
    script = (
        f"{result.stdout}\nkubectl get --raw /readyz && echo && helm version --short && command -v kubectl"
    )
    shell = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60
    )
    assert shell.returncode == 0, shell.stderr
    readyz, helm_version, kubectl_path = shell.stdout.split()
    assert (readyz, helm_version.split("+")[0]) == ("ok", "v3.22.0")
    assert Path(kubectl_path) == devcluster.binaries.path("kubectl")


def test_env_without_a_cluster_fails_with_one_clear_line(tmp_path: Path) -> None:
    result = dtjob_devcluster("env", env={**os.environ, "DTJOB_DEVCLUSTER_DIR": str(tmp_path)}, timeout=60)
    assert result.returncode != 0
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"devcluster: no cluster is running in {tmp_path}; start one with `dtjob devcluster up`"
    ]


def test_up_on_a_running_cluster_changes_nothing(devcluster: Devcluster) -> None:
    before = dtjob_devcluster("status", timeout=60).stdout
    again = dtjob_devcluster("up")
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stdout and "nothing changed" in again.stdout
    assert dtjob_devcluster("status", timeout=60).stdout == before  # same pids, all still healthy


def test_up_refuses_a_cluster_whose_pods_run_another_checkout(devcluster: Devcluster) -> None:
    # Every pod runs the code of the checkout that started its node: a clone's tests on the work
    # tree's cluster would test the work tree (issue #46). Pretend node 1 came from elsewhere.
    record = devcluster.layout.node_checkout_file("dtjob-node-1")
    ours = record.read_text()
    record.write_text("/elsewhere/dtjob\n")
    try:
        refused = dtjob_devcluster("up")
    finally:
        record.write_text(ours)
    assert refused.returncode != 0
    assert "dtjob-node-1 runs /elsewhere/dtjob" in refused.stderr, refused.stderr
    assert ours.strip() in refused.stderr and "`dtjob devcluster down`" in refused.stderr
    assert dtjob_devcluster("up").returncode == 0, "its own checkout again: nothing to refuse"


def test_up_leaves_a_node_stopped_on_purpose_stopped(devcluster: Devcluster) -> None:
    node = "dtjob-node-3"
    assert dtjob_devcluster("node", "stop", node).returncode == 0
    try:
        again = dtjob_devcluster("up")
        assert again.returncode == 0, again.stderr
        assert f"{node} stays stopped" in again.stdout
        rows = dtjob_devcluster("status", timeout=60).stdout.splitlines()
        row = next(line for line in rows if node in line)
        assert "(stopped)" in row and row.split()[2] == "-", row  # no nodelet pid
    finally:
        started = dtjob_devcluster("node", "start", node)
    assert started.returncode == 0, started.stderr
    assert dtjob_devcluster("status", timeout=60).returncode == 0  # every node Ready again


def test_up_with_another_shape_is_refused(devcluster: Devcluster) -> None:
    result = dtjob_devcluster("up", "--nodes", "5")
    assert result.returncode == 1
    assert "already up" in result.stderr and "dtjob devcluster down" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_second_cluster_on_taken_ports_fails_before_touching_anything(
    devcluster: Devcluster, tmp_path: Path
) -> None:
    result = dtjob_devcluster("up", env={**os.environ, "DTJOB_DEVCLUSTER_DIR": str(tmp_path)})
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("devcluster: port 23379 (needed by etcd) is in use")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]


@pytest.mark.slow
@pytest.mark.devcluster_restart
def test_down_leaves_nothing_behind_and_up_reuses_cached_binaries(devcluster: Devcluster) -> None:
    others = other_live_sessions(devcluster.layout)
    if others:
        pytest.skip(f"pytest sessions {others} also use the devcluster; `down` would break them")
    # A running pod gives `down` a network namespace, veth, /etc/netns entry and process to remove.
    token = f"dtjob-leftover-{uuid.uuid4().hex[:8]}"
    pod = f"""
apiVersion: v1
kind: Pod
metadata: {{name: {token}, namespace: default}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: python
    command: [python, -c, "import time; time.sleep(3600)", {token}]
"""
    kubectl("apply", "-f", "-", input=pod, check=True)
    wait_for(
        f"pod {token} Running",
        lambda: kubectl("get", "pod", token, "-o", "jsonpath={.status.phase}").stdout == "Running",
        timeout=90,
    )
    binaries = [devcluster.binaries.path(t) for t in ("etcd", *K8S_TOOLS, "helm")]
    stamps = {b: (b.stat().st_ino, b.stat().st_mtime_ns) for b in binaries}
    baseline = devcluster.host_before if devcluster.started_here else host_resources()

    down = dtjob_devcluster("down", timeout=300)
    assert down.returncode == 0, down.stderr
    root = f"{devcluster.layout.root}/"
    leftovers = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _mentions(p, (root, token))]
    assert leftovers == []
    after = host_resources()
    assert BRIDGE not in after["links"]
    assert not [link for link in after["links"] - baseline["links"] if link.startswith(("veth", "dtj"))]
    assert after["netns"] <= baseline["netns"]
    assert after["etc_netns"] <= baseline["etc_netns"]
    assert [m for m in after["mounts"] if m.startswith(root)] == []
    assert dtjob_devcluster("env", timeout=60).returncode != 0

    up = dtjob_devcluster("up")
    assert up.returncode == 0, up.stderr
    assert "building" not in up.stdout + up.stderr
    assert {b: (b.stat().st_ino, b.stat().st_mtime_ns) for b in binaries} == stamps
    assert kubectl("get", "pod", token, "--ignore-not-found", "-o", "name", check=True).stdout == ""
    nodes = kubectl_json("get", "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == NODES


def _mentions(proc: Path, needles: tuple[str, ...]) -> bool:
    try:
        text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and any(n in text for n in needles) and proc.name != str(os.getpid())
