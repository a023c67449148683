"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler: their certificates, their
command lines, and how to tell that each one is healthy."""

from __future__ import annotations

import ssl
import urllib.request
from pathlib import Path

from dtjob.devcluster import pki
from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.layout import (
    APISERVER_PORT,
    BRIDGE_ADDRESS,
    CONTROLLER_MANAGER_PORT,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    KUBERNETES_SERVICE_IP,
    POD_NETWORK,
    SCHEDULER_PORT,
    SERVICE_NETWORK,
    Layout,
)

APISERVER_URL = f"https://127.0.0.1:{APISERVER_PORT}"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
APISERVER_DNS_NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
    "localhost",
)
APISERVER_IPS = ("127.0.0.1", BRIDGE_ADDRESS, KUBERNETES_SERVICE_IP)
# Pods on a lost node are evicted this many seconds after the node is marked NotReady/unreachable
# (upstream default 300 s; tests of node loss should not wait five minutes).
TOLERATION_SECONDS = 10
# A node whose lease is not renewed for this long is marked NotReady (upstream 50 s). The nodelet
# renews every few seconds; 20 s still rides out a stall of this loaded 2-core machine.
NODE_MONITOR_GRACE = "20s"
NODE_MONITOR_PERIOD = "2s"
# Client rate limits of the scheduler (upstream 50 requests/s, burst 100) and the controller
# manager (20/s, burst 30): a 1,024-worker gang is 1,024 bindings, 20 s at the scheduler's default
# alone, and 500 jobs' EndpointSlices and garbage collection queue behind the manager's. A local
# test cluster has no other tenant to protect (kwokctl lifts these limits the same way).
SCHEDULER_QPS, SCHEDULER_BURST = 500, 1000
CONTROLLER_MANAGER_QPS, CONTROLLER_MANAGER_BURST = 200, 400


def ensure_pki(layout: Layout) -> None:
    """CA, service-account keys, and the certificates and kubeconfigs of the control plane."""
    p = layout.pki
    ca = pki.ensure_ca(p)
    pki.ensure_service_account_keys(p)
    pki.ensure_cert(
        ca,
        pki.CertKey(p / "apiserver.crt", p / "apiserver.key"),
        "kube-apiserver",
        dns_names=APISERVER_DNS_NAMES,
        ip_addresses=APISERVER_IPS,
        server=True,
    )
    # The API server's identity towards nodelets (logs, exec): a cluster admin, as in kubeadm.
    pki.ensure_cert(
        ca,
        pki.CertKey(p / "apiserver-kubelet-client.crt", p / "apiserver-kubelet-client.key"),
        "kube-apiserver-kubelet-client",
        organizations=("system:masters",),
        client=True,
    )
    # The aggregation layer's own CA and client (as kubeadm sets it up): without them every
    # component logs "missing content for CA bundle requestheader-client-ca-file" forever.
    front_proxy_ca = pki.ensure_ca(p, "front-proxy-ca", "dtjob-devcluster-front-proxy-ca")
    pki.ensure_cert(
        front_proxy_ca,
        pki.CertKey(p / "front-proxy-client.crt", p / "front-proxy-client.key"),
        "front-proxy-client",
        client=True,
    )
    clients = {
        "admin": ("kubernetes-admin", ("system:masters",)),
        "controller-manager": ("system:kube-controller-manager", ()),
        "scheduler": ("system:kube-scheduler", ()),
    }
    for stem, (cn, orgs) in clients.items():
        cert = pki.ensure_cert(ca, pki.CertKey(p / f"{stem}.crt", p / f"{stem}.key"), cn, orgs, client=True)
        kubeconfig = layout.admin_kubeconfig if stem == "admin" else layout.kubeconfig(stem)
        if not kubeconfig.exists():
            pki.write_kubeconfig(kubeconfig, APISERVER_URL, ca.cert, cert, cn)


def ensure_node_pki(layout: Layout, name: str) -> None:
    """A node's client identity (system:node:<name> in system:nodes, what the Node authorizer
    expects), its kubeconfig, and the serving certificate of its kubelet API."""
    d = layout.node_dir(name)
    ca = pki.ensure_ca(layout.pki)
    client = pki.ensure_cert(
        ca,
        pki.CertKey(d / "client.crt", d / "client.key"),
        f"system:node:{name}",
        ("system:nodes",),
        client=True,
    )
    pki.ensure_cert(
        ca,
        pki.CertKey(d / "serving.crt", d / "serving.key"),
        name,
        dns_names=(name,),
        ip_addresses=(BRIDGE_ADDRESS, "127.0.0.1"),
        server=True,
    )
    if not (d / "kubeconfig").exists():
        pki.write_kubeconfig(d / "kubeconfig", APISERVER_URL, ca.cert, client, f"system:node:{name}")


def command(component: str, layout: Layout, binaries: Binaries) -> list[str]:
    """The command line of one control-plane component."""
    p = layout.pki
    if component == "etcd":
        client, peer = f"http://127.0.0.1:{ETCD_CLIENT_PORT}", f"http://127.0.0.1:{ETCD_PEER_PORT}"
        return [
            str(binaries.path("etcd")),
            "--name=dtjob",
            f"--data-dir={layout.etcd_data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=dtjob={peer}",
            "--initial-cluster-state=new",
            # A throw-away test cluster: fsync per write would make every API call wait on the disk
            # this machine shares with builds and checkpoints.
            "--unsafe-no-fsync=true",
            "--log-level=warn",
        ]
    if component == "kube-apiserver":
        return [
            str(binaries.path("kube-apiserver")),
            f"--advertise-address={BRIDGE_ADDRESS}",
            "--bind-address=0.0.0.0",
            f"--secure-port={APISERVER_PORT}",
            f"--etcd-servers=http://127.0.0.1:{ETCD_CLIENT_PORT}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={layout.ca_cert}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_NETWORK}",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={layout.ca_cert}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--default-not-ready-toleration-seconds={TOLERATION_SECONDS}",
            f"--default-unreachable-toleration-seconds={TOLERATION_SECONDS}",
            f"--requestheader-client-ca-file={p / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
            "--allow-privileged=true",
            "--profiling=false",
        ]
    if component == "kube-controller-manager":
        kubeconfig = layout.kubeconfig("controller-manager")
        return [
            str(binaries.path("kube-controller-manager")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={CONTROLLER_MANAGER_PORT}",
            "--leader-elect=false",
            f"--root-ca-file={layout.ca_cert}",
            f"--service-account-private-key-file={p / 'sa.key'}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={layout.ca_cert}",
            f"--cluster-signing-key-file={p / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_NETWORK}",
            f"--cluster-cidr={POD_NETWORK}",
            # Each nodelet is given its pod CIDR on the command line (10.244.<i>.0/24).
            "--allocate-node-cidrs=false",
            f"--node-monitor-period={NODE_MONITOR_PERIOD}",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE}",
            f"--kube-api-qps={CONTROLLER_MANAGER_QPS}",
            f"--kube-api-burst={CONTROLLER_MANAGER_BURST}",
            "--profiling=false",
        ]
    if component == "kube-scheduler":
        kubeconfig = layout.kubeconfig("scheduler")
        return [
            str(binaries.path("kube-scheduler")),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={SCHEDULER_PORT}",
            "--leader-elect=false",
            f"--kube-api-qps={SCHEDULER_QPS}",
            f"--kube-api-burst={SCHEDULER_BURST}",
            "--profiling=false",
        ]
    raise ValueError(f"unknown control-plane component {component!r}")


# Where each component answers a health check, and which ports it listens on (checked before start).
HEALTH_URLS = {
    "etcd": f"http://127.0.0.1:{ETCD_CLIENT_PORT}/health",
    "kube-apiserver": f"{APISERVER_URL}/readyz",
    "kube-controller-manager": f"https://127.0.0.1:{CONTROLLER_MANAGER_PORT}/healthz",
    "kube-scheduler": f"https://127.0.0.1:{SCHEDULER_PORT}/healthz",
}
PORTS = {
    "etcd": (ETCD_CLIENT_PORT, ETCD_PEER_PORT),
    "kube-apiserver": (APISERVER_PORT,),
    "kube-controller-manager": (CONTROLLER_MANAGER_PORT,),
    "kube-scheduler": (SCHEDULER_PORT,),
}


def healthy(component: str, layout: Layout, timeout: float = 3.0) -> bool:
    """One health probe. The API server is asked as the admin (verifying its certificate); the
    controller manager and scheduler serve /healthz anonymously on a self-signed certificate."""
    url = HEALTH_URLS[component]
    context: ssl.SSLContext | None = None
    if component == "kube-apiserver":
        context = ssl.create_default_context(cafile=str(layout.ca_cert))
        context.load_cert_chain(str(layout.pki / "admin.crt"), str(layout.pki / "admin.key"))
    elif url.startswith("https"):
        context = ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            body = response.read().decode(errors="replace")
    except OSError:
        return False
    if component == "etcd":
        return '"health":"true"' in body.replace(" ", "")
    return body.strip() == "ok"


def last_log_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "no log"
    return lines[-1].strip()[:300] if lines else "empty log"
