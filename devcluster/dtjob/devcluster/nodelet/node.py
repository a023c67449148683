"""The Node object: registration, status heartbeats and the node Lease in kube-node-lease."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import platform
from pathlib import Path

from dtjob.devcluster.nodelet.config import NodeletConfig
from dtjob.devcluster.nodelet.kubeapi import ApiError, KubeApi, Obj
from dtjob.devcluster.nodelet.status import now

log = logging.getLogger(__name__)

# The lease lasts 40 s as the kubelet's, but is renewed every 4 s (the kubelet: 10 s) because the
# devcluster's controller-manager declares a node lost after only 20 s without a renewal, and a
# renewal can be slow on this loaded 2-core machine. The Node status is posted every 3rd beat.
LEASE_DURATION_S = 40
HEARTBEAT_S = 4
STATUS_EVERY = 3
MAX_PODS = "110"
LEASE_NAMESPACE = "kube-node-lease"
VERSIONS_ENV = Path(__file__).parents[3] / "versions.env"


def kubelet_version() -> str:
    """The cluster's Kubernetes version (devcluster/versions.env), shown as the node's version."""
    try:
        for line in VERSIONS_ENV.read_text().splitlines():
            if line.startswith("KUBERNETES_VERSION="):
                return "v" + line.split("=", 1)[1].strip()
    except OSError:
        pass
    return "v0.0.0-dtjob"


def arch() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def node_status(cfg: NodeletConfig, transition: bool = True) -> Obj:
    """The Node status; conditions carry lastTransitionTime only when the nodelet (re)starts, so
    heartbeats (strategic merge patches keyed by condition type) keep the earlier one."""
    capacity = {"cpu": cfg.cpus, "memory": cfg.memory, "pods": MAX_PODS, "nvidia.com/gpu": str(cfg.gpus)}
    stamp = now()

    def cond(kind: str, status: bool, reason: str, message: str) -> Obj:
        c = {
            "type": kind,
            "status": "True" if status else "False",
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": stamp,
        }
        return {**c, "lastTransitionTime": stamp} if transition else c

    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "addresses": [
            {"type": "InternalIP", "address": cfg.node_ip},
            {"type": "Hostname", "address": cfg.name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": cfg.kubelet_port}},
        "nodeInfo": {
            "kubeletVersion": kubelet_version(),
            "operatingSystem": "linux",
            "architecture": arch(),
            "kernelVersion": platform.release(),
            "osImage": "dtjob devcluster nodelet",
            "containerRuntimeVersion": "dtjob-nodelet://0.1",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        },
        "conditions": [
            cond("MemoryPressure", False, "KubeletHasSufficientMemory", "nodelet has sufficient memory"),
            cond("DiskPressure", False, "KubeletHasNoDiskPressure", "nodelet has no disk pressure"),
            cond("PIDPressure", False, "KubeletHasSufficientPID", "nodelet has sufficient PID available"),
            cond("Ready", True, "KubeletReady", "nodelet is posting ready status"),
        ],
    }


def node_object(cfg: NodeletConfig) -> Obj:
    labels = {"kubernetes.io/hostname": cfg.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": arch()}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": cfg.name, "labels": labels},
        "spec": {"podCIDR": cfg.pod_cidr, "podCIDRs": [cfg.pod_cidr]},
        "status": node_status(cfg),
    }


def micro_time() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeAgent:
    def __init__(self, api: KubeApi, cfg: NodeletConfig) -> None:
        self.api = api
        self.cfg = cfg
        self.path = f"/api/v1/nodes/{cfg.name}"
        self.uid = ""

    async def register(self) -> None:
        """Creates the Node, or brings an existing one (an earlier run's) up to date."""
        obj = node_object(self.cfg)
        try:
            created = await self.api.request("POST", "/api/v1/nodes", body=obj)
            self.uid = created["metadata"]["uid"]
            log.info("registered node %s", self.cfg.name)
        except ApiError as e:
            if e.status != 409:
                raise
            patched = await self.api.request(
                "PATCH", self.path, body={"metadata": {"labels": obj["metadata"]["labels"]}}
            )
            self.uid = patched["metadata"]["uid"]
            log.info("node %s exists; updating it", self.cfg.name)
        await self.post_status(transition=True)

    async def post_status(self, transition: bool = False) -> None:
        try:
            await self.api.request(
                "PATCH",
                self.path + "/status",
                body={"status": node_status(self.cfg, transition)},
                patch="strategic",
            )
        except ApiError as e:
            if e.status != 404:
                raise
            log.warning("node %s was deleted; registering it again", self.cfg.name)
            await self.register()

    async def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.cfg.name}"
        spec = {
            "holderIdentity": self.cfg.name,
            "leaseDurationSeconds": LEASE_DURATION_S,
            "renewTime": micro_time(),
        }
        try:
            await self.api.request("PATCH", path, body={"spec": spec})
        except ApiError as e:
            if e.status != 404:
                raise
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.cfg.name, "uid": self.uid}
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.cfg.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
                "spec": spec,
            }
            await self.api.request(
                "POST", f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", body=lease
            )

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Renews the lease every HEARTBEAT_S and posts the Ready status every STATUS_EVERY beats;
        failures are logged and retried at the next beat."""
        beat = 0
        while not stop.is_set():
            steps = [self.renew_lease] + ([self.post_status] if beat % STATUS_EVERY == 0 else [])
            for step in steps:
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("node heartbeat (%s): %s", step.__name__, e)
            beat += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEARTBEAT_S)
