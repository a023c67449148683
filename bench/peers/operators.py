"""The two operators as host processes on the devcluster: dtjob's (`dtjob operator`, the admin
kubeconfig, as the e2e tests run it) and Kubeflow's training-operator v1.8.1 (built from the Go
module proxy by build-training-operator.sh, with its own ServiceAccount, its upstream ClusterRole
and a token kubeconfig).

The training-operator's webhook, as upstream ships it, is on: its cert rotator wants the Secret
`training-operator-webhook-cert` in `kubeflow` and the ValidatingWebhookConfiguration
`validator.training-operator.kubeflow.org`. The devcluster routes no ClusterIPs (and the API
server resolves a webhook Service to its ClusterIP), so the webhook's clientConfig is a URL on this
machine, https://127.0.0.1:<port>/validate-kubeflow-org-v1-pytorchjob, with upstream's
failurePolicy Fail. The Secret is created beforehand holding a CA and a serving certificate for
both `training-operator.kubeflow.svc` (what the rotator checks) and IP 127.0.0.1 (what the API
server dials). The rotator finds them valid and keeps them, injects the CA into the webhook
configuration, and waits for the files in the webhook server's cert dir, which in a pod the
Secret's volume mount provides: the bench writes them there. So every PyTorchJob create and update
is validated by the real webhook over verified TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from bench.peers.kube import BenchError, ProcessUsage, apply_docs, kubectl, layout, wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dtjob.devcluster.host import admin_env, free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DTJOB_CRD = REPO / "crds" / "training.dtjob.io_distributedtrainingjobs.yaml"
KUBEFLOW_NS = "kubeflow"
WEBHOOK_SECRET = "training-operator-webhook-cert"
WEBHOOK_CONFIG = "validator.training-operator.kubeflow.org"
WEBHOOK_DNS = f"training-operator.{KUBEFLOW_NS}.svc"
CA_NAME = "training-operator-ca"  # the rotator checks the CA certificate against this name
# Where v1.8.1's webhook server reads its certificate (fixed in its pkg/cert, not a flag).
WEBHOOK_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")


def training_operator_version() -> str:
    for line in (HERE / "versions.env").read_text().splitlines():
        if line.startswith("TRAINING_OPERATOR_VERSION="):
            return line.split("=", 1)[1].strip()
    raise BenchError(f"{HERE / 'versions.env'} does not pin TRAINING_OPERATOR_VERSION")


def build_training_operator() -> Path:
    """Builds (or finds cached) the training-operator; returns its cache directory."""
    result = subprocess.run(
        ["bash", str(HERE / "build-training-operator.sh")], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise BenchError(f"building the training-operator failed:\n{result.stderr[-3000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


@dataclass
class HostOperator:
    """An operator process on this machine, serving one namespace."""

    name: str
    namespace: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    usage: ProcessUsage | None = None
    started_at: float = 0.0
    ready_seconds: float = 0.0

    def command(self) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        argv, env = self.command()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.started_at = time.monotonic()
        self.usage = ProcessUsage(self.proc.pid)
        wait_for(f"{self.name} ready (log {self.log})", self._ready_or_dead, timeout=180, interval=0.5)
        self.ready_seconds = time.monotonic() - self.started_at

    def _ready_or_dead(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise SystemExit(
                f"{self.name} exited with {self.proc.returncode} at start; its log ends:\n{tail}"
            )
        return self.ready()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@dataclass
class DtjobOperator(HostOperator):
    """`dtjob operator --namespace NS --standalone` with every other setting at its default
    (a 5 s reconcile timer besides the watch events)."""

    liveness_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv = [
            sys.executable,
            "-m",
            "dtjob.cli",
            "operator",
            "--namespace",
            self.namespace,
            "--standalone",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--metrics-port",
            str(self.metrics_port),
        ]
        return argv, admin_env()

    def ready(self) -> bool:
        return _http_ok(f"http://127.0.0.1:{self.liveness_port}/healthz")


def install_dtjob_crd() -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(DTJOB_CRD))
    wait_established("distributedtrainingjobs.training.dtjob.io")


def wait_established(crd: str) -> None:
    """Polls for the CRD's Established condition: `kubectl wait` right after the apply fails with
    "status.conditions accessor error" while the API server has not written any condition yet."""
    jsonpath = '{.status.conditions[?(@.type=="Established")].status}'

    def established() -> bool:
        return kubectl("get", "crd", crd, "-o", f"jsonpath={jsonpath}", check=False).stdout.strip() == "True"

    wait_for(f"CRD {crd} Established", established, timeout=60)


# --- the training-operator ---------------------------------------------------------------------------


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    # PKCS#1 ("RSA PRIVATE KEY"), the form the rotator itself writes and parses.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def webhook_certificates() -> dict[str, bytes]:
    """A CA and a serving certificate the cert rotator accepts as its own (CA named CA_NAME,
    server valid for WEBHOOK_DNS; both ten years, beyond its 90-day look-ahead) that also name
    127.0.0.1, where the API server reaches the webhook."""
    now = datetime.datetime.now(datetime.UTC)
    begin, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=3650)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "training-operator"),
        ]
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_encipherment=True,
                key_cert_sign=True,
                content_commitment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(CA_NAME)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, WEBHOOK_DNS)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(WEBHOOK_DNS), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        "ca.crt": ca.public_bytes(pem),
        "ca.key": _pem_key(ca_key),
        "tls.crt": cert.public_bytes(pem),
        "tls.key": _pem_key(key),
    }


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def install_training_operator(bin_dir: Path, webhook_port: int, scratch: Path) -> Path:
    """The PyTorchJob CRD, namespace `kubeflow`, the ServiceAccount with upstream's ClusterRole,
    the webhook Secret and configuration; returns a kubeconfig holding the ServiceAccount's token."""
    import base64

    kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        str(bin_dir / "crds" / "kubeflow.org_pytorchjobs.yaml"),
    )
    wait_established("pytorchjobs.kubeflow.org")
    kubectl("create", "namespace", KUBEFLOW_NS, check=False)
    rbac = [
        doc
        for f in ("service-account.yaml", "role.yaml", "cluster-role-binding.yaml")
        for doc in _yaml_docs(bin_dir / "rbac" / f)
    ]
    for doc in rbac:
        if doc["kind"] == "ServiceAccount":
            doc["metadata"]["namespace"] = KUBEFLOW_NS
        if doc["kind"] == "ClusterRoleBinding":
            for s in doc["subjects"]:
                s["namespace"] = KUBEFLOW_NS
    apply_docs(rbac)
    certs = webhook_certificates()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": WEBHOOK_SECRET, "namespace": KUBEFLOW_NS},
        "data": {k: base64.b64encode(v).decode() for k, v in certs.items()},
    }
    kubectl("delete", "secret", WEBHOOK_SECRET, "-n", KUBEFLOW_NS, "--ignore-not-found")
    apply_docs([secret])
    # In a cluster the kubelet mounts the Secret at the webhook server's cert dir; the rotator only
    # waits for the files there (and gives up after ~17 min of backoff), so the bench writes them.
    WEBHOOK_CERT_DIR.mkdir(parents=True, exist_ok=True)
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (WEBHOOK_CERT_DIR / name).write_bytes(certs[name])
    upstream = _yaml_docs(bin_dir / "webhook" / "manifests.yaml")[0]
    hooks = [h for h in upstream["webhooks"] if "pytorchjob" in h["name"]]
    for h in hooks:
        path = h["clientConfig"]["service"]["path"]
        h["clientConfig"] = {"url": f"https://127.0.0.1:{webhook_port}{path}"}
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": WEBHOOK_CONFIG},
        "webhooks": hooks,
    }
    kubectl("delete", "validatingwebhookconfiguration", WEBHOOK_CONFIG, "--ignore-not-found")
    apply_docs([config])
    token = kubectl(
        "create", "token", "training-operator", "-n", KUBEFLOW_NS, "--duration=24h"
    ).stdout.strip()
    kubeconfig = scratch / "training-operator.kubeconfig"
    kubeconfig.parent.mkdir(parents=True, exist_ok=True)
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "training-operator",
                "clusters": [
                    {
                        "name": "devcluster",
                        "cluster": {
                            "server": "https://127.0.0.1:6443",
                            "certificate-authority": str(layout().ca_cert),
                        },
                    }
                ],
                "users": [{"name": "training-operator", "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "training-operator",
                        "context": {"cluster": "devcluster", "user": "training-operator"},
                    }
                ],
            }
        )
    )
    kubeconfig.chmod(0o600)
    return kubeconfig


@dataclass
class TrainingOperator(HostOperator):
    """Kubeflow's training-operator, only the PyTorchJob scheme, no leader election, watching one
    namespace; upstream's defaults otherwise (one controller thread)."""

    binary: Path = Path()
    kubeconfig: Path = Path()
    webhook_port: int = 0
    metrics_port: int = field(default_factory=free_port)
    probe_port: int = field(default_factory=free_port)

    def command(self) -> tuple[list[str], dict[str, str]]:
        argv = [
            str(self.binary),
            f"--kubeconfig={self.kubeconfig}",
            "--enable-scheme=pytorchjob",
            "--leader-elect=false",
            f"--namespace={self.namespace}",
            f"--metrics-bind-address=127.0.0.1:{self.metrics_port}",
            f"--health-probe-bind-address=127.0.0.1:{self.probe_port}",
            f"--webhook-server-port={self.webhook_port}",
        ]
        # MY_POD_NAMESPACE: where the rotator looks for its Secret (its default, kubeflow).
        return argv, {"PATH": os.environ.get("PATH", ""), "MY_POD_NAMESPACE": KUBEFLOW_NS}

    def ready(self) -> bool:
        return _http_ok(f"http://127.0.0.1:{self.probe_port}/readyz")


def webhook_says(manifest: dict[str, Any]) -> str:
    """What the webhook answers to a server-side dry run of `manifest` (proof that it validates)."""
    import json

    result = kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(manifest), check=False)
    return (result.stdout + result.stderr).strip()
