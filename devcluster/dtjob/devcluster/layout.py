"""Where the devcluster keeps its state, and the fixed names and ports everyone relies on.

The state directory lives outside the checkout ($DTJOB_DEVCLUSTER_DIR, default
/var/tmp/dtjob-devcluster) so `git clean` never kills it and several test sessions of one checkout
share it (pods run the code of the checkout that started their node: `up` refuses another's):

    pki/                  CA, service-account keys, component certificates
    admin.kubeconfig      cluster-admin credentials (what `dtjob devcluster env` exports)
    cluster.json          the `up` options the running cluster was started with
    etcd/                 etcd's data (deleted by `down`)
    logs/<component>.log  stdout+stderr of every process
    pids/<component>.pid  control-plane pids
    nodes/<node>/         each nodelet's kubeconfig, certificates, pid and pod state
    volcano/              vc-scheduler's configuration, cache dumps and log-level socket (`up --volcano`)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STATE_DIR = Path("/var/tmp/dtjob-devcluster")

# Ports: etcd is moved off its defaults (2379/2380) so a developer's own etcd does not clash.
ETCD_CLIENT_PORT = 23379
ETCD_PEER_PORT = 23380
APISERVER_PORT = 6443
CONTROLLER_MANAGER_PORT = 10257
SCHEDULER_PORT = 10259
# Node i (1-based) serves the kubelet API on 10250 + i; all nodes share the bridge address.
KUBELET_BASE_PORT = 10250
# Volcano (`up --volcano`), loopback only: health checks on vc-scheduler's default healthz port
# 11251 and the one after it, metrics beside them (their defaults, :8080 and :8081, are too
# commonly taken).
VOLCANO_SCHEDULER_HEALTHZ_PORT = 11251
VOLCANO_CONTROLLER_MANAGER_HEALTHZ_PORT = 11252
VOLCANO_SCHEDULER_METRICS_PORT = 11261
VOLCANO_CONTROLLER_MANAGER_METRICS_PORT = 11262

# Networking contract with the nodelet: one bridge; pods of node i get 10.244.i.0/24 and route
# via the bridge address, which is also where pods reach the API server.
BRIDGE = "dtjob0"
BRIDGE_ADDRESS = "10.244.0.1"
BRIDGE_PREFIX_LEN = 16
POD_NETWORK = "10.244.0.0/16"
SERVICE_NETWORK = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def node_name(index: int) -> str:
    """Name of node `index` (1-based)."""
    return f"dtjob-node-{index}"


def node_index(name: str) -> int:
    """Inverse of node_name; raises ValueError with the expected form on anything else."""
    prefix = "dtjob-node-"
    suffix = name[len(prefix) :]
    if not name.startswith(prefix) or not suffix.isdigit() or int(suffix) < 1:
        raise ValueError(f"node name {name!r} is not of the form {prefix}<N> (N >= 1)")
    return int(suffix)


def pod_cidr(index: int) -> str:
    return f"10.244.{index}.0/24"


@dataclass(frozen=True)
class Layout:
    """Paths inside one state directory."""

    root: Path

    @classmethod
    def from_env(cls) -> Layout:
        return cls(Path(os.environ.get("DTJOB_DEVCLUSTER_DIR") or DEFAULT_STATE_DIR).absolute())

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def ca_cert(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def cluster_file(self) -> Path:
        return self.root / "cluster.json"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    @property
    def volcano_dir(self) -> Path:
        return self.root / "volcano"

    @property
    def bridge_owner(self) -> Path:
        return self.root / "bridge.owner"

    @property
    def saved_ip_forward(self) -> Path:
        return self.root / "ip_forward.saved"

    @property
    def lock_file(self) -> Path:
        return self.root / "lock"

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    def pid_file(self, component: str) -> Path:
        return self.pids / f"{component}.pid"

    def kubeconfig(self, component: str) -> Path:
        return self.pki / f"{component}.kubeconfig"

    def node_dir(self, name: str) -> Path:
        return self.nodes / name

    def node_pid_file(self, name: str) -> Path:
        return self.node_dir(name) / "nodelet.pid"

    def node_checkout_file(self, name: str) -> Path:
        """The checkout whose Python and sources the node's nodelet, and so its pods, run."""
        return self.node_dir(name) / "checkout"

    def node_stopped_file(self, name: str) -> Path:
        """Present while a node is stopped on purpose (`node stop`): `up` leaves it stopped."""
        return self.node_dir(name) / "stopped"
