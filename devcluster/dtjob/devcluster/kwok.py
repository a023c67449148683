"""Simulated nodes: KWOK (sigs.k8s.io/kwok) against the devcluster's API server.

`dtjob devcluster up --fake-nodes N` starts one `kwok` controller (admin kubeconfig, built by
devcluster/build-kwok.sh) and registers N Node objects `dtjob-kwok-<i>` carrying the annotation
it manages (`kwok.x-k8s.io/node: fake`). KWOK marks them Ready, renews their leases, and turns
every pod bound to them Running at once without running anything; a deleted pod is removed at
once. A test fails or finishes such a pod by patching its status with the admin client.

Simulated nodes carry the taint `kwok.x-k8s.io/node=fake:NoSchedule` and the label
`type=kwok`: only pods that tolerate the taint land there, so the real nodelets' tests never get
a pod that runs nothing. Simulated pods get IPs from FAKE_POD_CIDR, inside the devcluster's pod
network on its own bridge, where no host answers: whatever connects to one (the operator's
metrics scrape of rank 0) never leaves this machine.

Unlike the nodelets, the number of simulated nodes may change on a running cluster (they are only
API objects): `up --fake-nodes M` adds or removes nodes, `up --fake-nodes 0` removes them all
and stops KWOK.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

from dtjob.devcluster import processes
from dtjob.devcluster.apiclient import ApiClient
from dtjob.devcluster.binaries import (
    DEVCLUSTER_SOURCE,
    cache_dir,
    check_go_buildable,
    read_versions,
    run_go_build,
)
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.host import port_free
from dtjob.devcluster.layout import BRIDGE_ADDRESS, POD_NETWORK, Layout

COMPONENT = "kwok"
BUILD_SCRIPT = DEVCLUSTER_SOURCE / "build-kwok.sh"
NODE_PREFIX = "dtjob-kwok-"
ANNOTATION = "kwok.x-k8s.io/node"
ANNOTATION_VALUE = "fake"
TAINT = {"key": ANNOTATION, "value": ANNOTATION_VALUE, "effect": "NoSchedule"}
NODE_LABEL = ("type", "kwok")
# What a pod needs to be placed on a simulated node (and only there).
TOLERATION = {"key": ANNOTATION, "operator": "Equal", "value": ANNOTATION_VALUE, "effect": "NoSchedule"}
NODE_SELECTOR = {NODE_LABEL[0]: NODE_LABEL[1]}
# Simulated pods' IPs: 16,384 addresses (2,000 pods of 500 jobs and a 1,024-worker gang fit at
# once) inside POD_NETWORK, above the nodelets' 10.244.<i>.0/24 for i < 192.
FAKE_POD_CIDR = "10.244.192.0/18"
MAX_NODELETS_BESIDE = 191
# KWOK's own server (health checks), loopback only; below the nodelets' kubelet ports 10251+.
SERVER_PORT = 10240
# KWOK renews each simulated node's lease every quarter of this (as the kubelet does: 40 s, 10 s);
# the devcluster marks a node NotReady 20 s after its last renewal.
LEASE_SECONDS = 40
# Stage plays KWOK runs at once (its default is 4): pods of a 1,024-worker gang go Running in
# about a second instead of waiting in KWOK's queue behind each other.
POD_PLAY_PARALLELISM = 16
# Leases KWOK renews at once (its default is 4): with 4, the renewals of 128 simulated nodes on a
# machine at load 15 fall behind and nodes turn NotReady in the middle of a 256-worker run.
NODE_LEASE_PARALLELISM = 16
READY_TIMEOUT = 180.0


def version() -> str:
    versions = read_versions()
    if "KWOK_VERSION" not in versions:
        raise DevclusterError("devcluster/versions.env does not pin KWOK_VERSION")
    return versions["KWOK_VERSION"]


def bin_dir() -> Path:
    """Cached per version and per build-kwok.sh's patch of it (KWOK_PATCH)."""
    patch = read_versions().get("KWOK_PATCH", "0")
    return cache_dir() / "bin" / f"kwok-v{version()}-p{patch}"


def binary() -> Path:
    return bin_dir() / "kwok"


def stages_dir() -> Path:
    return bin_dir() / "stages"


def node_name(index: int) -> str:
    return f"{NODE_PREFIX}{index}"


def _built() -> bool:
    return os.access(binary(), os.X_OK) and stages_dir().is_dir()


def check_buildable() -> None:
    check_go_buildable(f"KWOK v{version()}", _built(), bin_dir(), BUILD_SCRIPT)


def build_missing(log: Path) -> bool:
    """Runs the build script when KWOK is not cached; returns whether a build ran."""
    check_buildable()
    return run_go_build(f"kwok v{version()}", BUILD_SCRIPT, log, _built, "about 7 minutes")


def state_dir(layout: Layout) -> Path:
    return layout.root / "kwok"


def write_config(layout: Layout) -> Path:
    """KWOK's --config: its options and the module's stages (build-kwok.sh says which)."""
    # A configuration file's options get no defaults (an unset parallelism is 0, which KWOK
    # refuses): every option with an upstream default is written out, at that default but one.
    options = {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokConfiguration",
        "options": {
            "cidr": FAKE_POD_CIDR,
            "manageAllNodes": False,
            "enableDebuggingHandlers": True,
            "enableContentionProfiling": False,
            "enableProfilingHandler": True,
            "podPlayStageParallelism": POD_PLAY_PARALLELISM,
            "nodePlayStageParallelism": 4,
            "nodeLeaseParallelism": NODE_LEASE_PARALLELISM,
            "podsOnNodeSyncParallelism": 1,
            "enablePodsOnNodeSyncListPager": True,
            "enablePodsOnNodeSyncStreamWatch": False,
        },
    }
    docs = [json.dumps(options)]
    docs += [p.read_text() for p in sorted(stages_dir().glob("*.yaml"))]
    path = state_dir(layout) / "kwok.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n---\n".join(docs) + "\n")
    return path


def command(layout: Layout, config: Path) -> list[str]:
    return [
        str(binary()),
        f"--kubeconfig={layout.admin_kubeconfig}",
        f"--config={config}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={ANNOTATION}={ANNOTATION_VALUE}",
        f"--cidr={FAKE_POD_CIDR}",
        f"--node-ip={BRIDGE_ADDRESS}",
        f"--node-lease-duration-seconds={LEASE_SECONDS}",
        f"--server-address=127.0.0.1:{SERVER_PORT}",
    ]


def pid(layout: Layout) -> int | None:
    return processes.read_pid(layout.pid_file(COMPONENT), f"{layout.root}/")


def healthy(timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{SERVER_PORT}/healthz", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def node_manifest(name: str, gpus: int, cpus: str, memory: str, pods: int) -> dict[str, Any]:
    capacity = {"cpu": cpus, "memory": memory, "pods": str(pods), "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {ANNOTATION: ANNOTATION_VALUE, "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                NODE_LABEL[0]: NODE_LABEL[1],
            },
        },
        "spec": {"taints": [TAINT]},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [
                {"type": "InternalIP", "address": BRIDGE_ADDRESS},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def registered(client: ApiClient) -> list[str]:
    """Names of the simulated nodes the API server has."""
    status, body = client.get(f"/api/v1/nodes?labelSelector={NODE_LABEL[0]}%3D{NODE_LABEL[1]}")
    if status != 200:
        raise DevclusterError(f"listing the simulated nodes failed with HTTP {status}: {body[:200]}")
    items = json.loads(body).get("items", [])
    return sorted(
        n["metadata"]["name"]
        for n in items
        if (n["metadata"].get("annotations") or {}).get(ANNOTATION) == ANNOTATION_VALUE
    )


def check_shape(nodelets: int) -> None:
    if nodelets > MAX_NODELETS_BESIDE:
        raise DevclusterError(
            f"--fake-nodes needs --nodes <= {MAX_NODELETS_BESIDE}: nodelet pod networks 10.244.<i>.0/24 "
            f"from i = 192 on overlap the simulated pods' {FAKE_POD_CIDR}"
        )
    if not ipaddress.IPv4Network(FAKE_POD_CIDR).subnet_of(ipaddress.IPv4Network(POD_NETWORK)):
        raise DevclusterError(f"{FAKE_POD_CIDR} is not inside the pod network {POD_NETWORK}")


def ensure(
    layout: Layout, count: int, gpus: int, cpus: str, memory: str, pods: int, started: list[str]
) -> None:
    """KWOK running and exactly `count` simulated nodes registered and Ready (count 0: none, and
    KWOK stopped). Appends "kwok" to `started` when it started the controller."""
    client = ApiClient(layout)
    have = registered(client)
    wanted = [node_name(i) for i in range(1, count + 1)]
    for name in sorted(set(have) - set(wanted)):
        status = client.delete(f"/api/v1/nodes/{name}")
        if status not in (200, 202, 404):
            raise DevclusterError(f"deleting simulated node {name} failed with HTTP {status}")
    if count == 0:
        stop(layout)
        return
    running = pid(layout)
    if running is None:
        if not port_free(SERVER_PORT, "127.0.0.1"):
            raise DevclusterError(
                f"port {SERVER_PORT} (needed by kwok) is in use by another process; stop it "
                f"(`ss -ltnp 'sport = :{SERVER_PORT}'` shows which) and retry"
            )
        config = write_config(layout)
        running = processes.start(command(layout, config), layout.log(COMPONENT), layout.pid_file(COMPONENT))
        started.append(COMPONENT)
    deadline = time.monotonic() + READY_TIMEOUT
    while not healthy():
        if not processes.is_running(running):
            raise DevclusterError(f"kwok exited during start-up; see {layout.log(COMPONENT)}")
        if time.monotonic() > deadline:
            raise DevclusterError(
                f"kwok was not healthy after {READY_TIMEOUT:.0f}s; see {layout.log(COMPONENT)}"
            )
        time.sleep(0.5)
    for name in wanted:
        if name in have:
            continue
        status = client.create("/api/v1/nodes", node_manifest(name, gpus, cpus, memory, pods))
        if status not in (200, 201, 409):
            raise DevclusterError(f"registering simulated node {name} failed with HTTP {status}")
    while True:
        ready = client.node_ready()
        waiting = [n for n in wanted if not ready.get(n)]
        if not waiting:
            return
        if not processes.is_running(running):
            raise DevclusterError(f"kwok exited; see {layout.log(COMPONENT)}")
        if time.monotonic() > deadline:
            raise DevclusterError(
                f"{len(waiting)} simulated nodes ({waiting[0]}, ...) not Ready after "
                f"{READY_TIMEOUT:.0f}s; see {layout.log(COMPONENT)}"
            )
        time.sleep(0.5)


def stop(layout: Layout) -> None:
    """Stops KWOK and removes its state (the simulated Node objects stay until deleted)."""
    running = pid(layout)
    if running is not None:
        processes.stop(running)
    layout.pid_file(COMPONENT).unlink(missing_ok=True)
    shutil.rmtree(state_dir(layout), ignore_errors=True)


def status_lines(layout: Layout, count: int) -> tuple[bool, list[str]]:
    """`status`'s lines about KWOK and the simulated nodes, and whether all is healthy."""
    running = pid(layout)
    good = running is not None and healthy()
    lines = [f"{COMPONENT:<26}{running or '-':>8}  {'yes' if running else 'no':<6} {'yes' if good else 'no'}"]
    ready = ApiClient(layout).node_ready()
    names = [node_name(i) for i in range(1, count + 1)]
    n_ready = sum(1 for n in names if ready.get(n))
    lines.append(f"simulated nodes ({NODE_PREFIX}1..{count}): {n_ready} of {count} Ready")
    return good and n_ready == count, lines
