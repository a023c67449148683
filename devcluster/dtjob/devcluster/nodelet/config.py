"""The nodelet's command line (the contract with `dtjob devcluster up`)."""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NodeletConfig:
    name: str
    kubeconfig: Path
    state_dir: Path
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    kubelet_port: int
    node_ip: str
    pod_cidr: str
    bridge: str
    bridge_prefix_len: int
    cpus: str
    memory: str
    gpus: int


def parse_args(argv: list[str] | None = None) -> NodeletConfig:
    p = argparse.ArgumentParser(
        prog="python -m dtjob.devcluster.nodelet", description="dtjob's kubelet for this machine"
    )
    p.add_argument("--name", required=True, help="Node name (the kubeconfig must be system:node:<name>)")
    p.add_argument("--kubeconfig", required=True, type=Path)
    p.add_argument("--state-dir", required=True, type=Path, help="where pod state, volumes and logs live")
    p.add_argument(
        "--ca-cert", required=True, type=Path, help="cluster CA (pods' ca.crt, kubelet API clients)"
    )
    p.add_argument("--serving-cert", required=True, type=Path, help="TLS certificate of the kubelet API")
    p.add_argument("--serving-key", required=True, type=Path)
    p.add_argument("--kubelet-port", required=True, type=int)
    p.add_argument("--node-ip", required=True, help="the node's InternalIP, also the pods' gateway")
    p.add_argument("--pod-cidr", required=True, help="this node's pod addresses, e.g. 10.244.1.0/24")
    p.add_argument("--bridge", default="dtjob0", help="bridge the pod veths attach to")
    p.add_argument(
        "--bridge-prefix-len", type=int, default=16, help="prefix length of the pod network on the bridge"
    )
    p.add_argument("--cpus", default="2", help="cpu capacity (a Kubernetes quantity)")
    p.add_argument("--memory", default="4Gi", help="memory capacity (a Kubernetes quantity)")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity")
    a = p.parse_args(argv)
    for flag in ("kubeconfig", "ca_cert", "serving_cert", "serving_key"):
        if not getattr(a, flag).is_file():
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: no such file")
    try:
        ipaddress.ip_network(a.pod_cidr)
        ipaddress.ip_address(a.node_ip)
    except ValueError as e:
        p.error(f"--pod-cidr/--node-ip: {e}")
    if a.gpus < 0 or not 0 < a.kubelet_port < 65536:
        p.error("--gpus must be >= 0 and --kubelet-port in 1..65535")
    return NodeletConfig(
        name=a.name,
        kubeconfig=a.kubeconfig,
        state_dir=a.state_dir.absolute(),
        ca_cert=a.ca_cert,
        serving_cert=a.serving_cert,
        serving_key=a.serving_key,
        kubelet_port=a.kubelet_port,
        node_ip=a.node_ip,
        pod_cidr=a.pod_cidr,
        bridge=a.bridge,
        bridge_prefix_len=a.bridge_prefix_len,
        cpus=a.cpus,
        memory=a.memory,
        gpus=a.gpus,
    )
