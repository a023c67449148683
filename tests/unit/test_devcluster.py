"""The devcluster's pure parts: certificates, versions, names, and the CLI's bad-input errors."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dtjob.devcluster import controlplane, nodes
from dtjob.devcluster.binaries import VERSIONS_FILE, Binaries, read_versions
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.layout import Layout, node_index, node_name


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """verify_directly_issued_by raises (InvalidSignature, ValueError) unless ca signed cert."""
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    cert.verify_directly_issued_by(ca)
    return True


def test_apiserver_certificate_covers_every_name_pods_and_users_use(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    controlplane.ensure_pki(layout)
    ca = _cert(layout.ca_cert)
    cert = _cert(layout.pki / "apiserver.crt")
    assert _signed_by(cert, ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(ip) for ip in ("127.0.0.1", "10.244.0.1", "10.96.0.1")
    }
    assert "kubernetes.default.svc.cluster.local" in sans.get_values_for_type(x509.DNSName)
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]


def test_node_identity_is_what_the_node_authorizer_expects(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    controlplane.ensure_node_pki(layout, "dtjob-node-2")
    d = layout.node_dir("dtjob-node-2")
    client = _cert(d / "client.crt")
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:dtjob-node-2"
    assert client.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    assert _signed_by(client, _cert(layout.ca_cert))
    serving = _cert(d / "serving.crt")
    sans = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.244.0.1") in sans.get_values_for_type(x509.IPAddress)
    assert "dtjob-node-2" in sans.get_values_for_type(x509.DNSName)
    kubeconfig = (d / "kubeconfig").read_text()
    assert "server: https://127.0.0.1:6443" in kubeconfig
    assert f"client-certificate: {d / 'client.crt'}" in kubeconfig


def test_certificates_are_reused_not_regenerated(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    controlplane.ensure_pki(layout)
    first = (layout.pki / "admin.crt").read_bytes(), layout.admin_kubeconfig.read_bytes()
    controlplane.ensure_pki(layout)
    assert ((layout.pki / "admin.crt").read_bytes(), layout.admin_kubeconfig.read_bytes()) == first
    assert (layout.pki / "ca.key").stat().st_mode & 0o777 == 0o600


def test_versions_file_pins_the_cluster_versions() -> None:
    versions = read_versions(VERSIONS_FILE)
    assert versions["KUBERNETES_VERSION"] == "1.37.2"
    assert Binaries.pinned().path("kubectl").parent.name == "k8s-v1.37.2"


def test_malformed_versions_file_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "versions.env"
    bad.write_text("# pins\nKUBERNETES_VERSION\n")
    with pytest.raises(DevclusterError, match=r"versions.env:2: expected KEY=VALUE"):
        read_versions(bad)


def test_node_names_round_trip_and_bad_ones_are_explained() -> None:
    assert node_index(node_name(7)) == 7
    with pytest.raises(ValueError, match="dtjob-node-<N>"):
        node_index("worker-1")


def _devcluster(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dtjob.cli", "devcluster", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=60,
        check=False,
    )


def test_up_without_go_and_without_cached_binaries_says_what_to_install(tmp_path: Path) -> None:
    python_only = str(Path(sys.executable).parent) + ":/usr/sbin:/usr/bin:/bin"
    result = _devcluster(
        "up", DTJOB_CACHE=str(tmp_path / "cache"), DTJOB_DEVCLUSTER_DIR=str(tmp_path / "dc"), PATH=python_only
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("devcluster: the Go toolchain is missing") and "install Go" in line
    assert not (tmp_path / "dc" / "pki").exists()


def test_bad_quantity_names_the_flag() -> None:
    result = _devcluster("up", "--memory-per-node", "lots")
    assert result.returncode == 2
    assert "--memory-per-node" in result.stderr and "8Gi" in result.stderr


def test_node_command_rejects_unknown_names() -> None:
    result = _devcluster("node", "stop", "node-a")
    assert result.returncode == 2
    assert "dtjob-node-<N>" in result.stderr


def test_net_command_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    result = _devcluster("net", "down", "job-worker-1", "-n", "ns", DTJOB_DEVCLUSTER_DIR=str(tmp_path / "dc"))
    assert result.returncode == 1
    assert "no cluster is running" in result.stderr and "dtjob devcluster up" in result.stderr


def test_restart_command_names_the_components_and_needs_a_cluster(tmp_path: Path) -> None:
    result = _devcluster("restart", "kubelet")
    assert result.returncode == 2 and "'etcd', 'kube-apiserver'" in result.stderr
    result = _devcluster("restart", "etcd", "--down=1", DTJOB_DEVCLUSTER_DIR=str(tmp_path / "dc"))
    assert result.returncode == 1
    assert "no cluster is running" in result.stderr and "dtjob devcluster up" in result.stderr


def test_net_command_takes_only_down_or_up() -> None:
    result = _devcluster("net", "sideways", "job-worker-1")
    assert result.returncode == 2
    assert "'down', 'up'" in result.stderr


def test_a_cluster_whose_nodes_run_another_checkout_is_refused_naming_it(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    ours = str(nodes.CHECKOUT)
    nodes.check_same_checkout(layout, {"dtjob-node-1": ours, "dtjob-node-2": ours})
    with pytest.raises(DevclusterError) as refused:
        nodes.check_same_checkout(
            layout, {"dtjob-node-1": ours, "dtjob-node-2": "/elsewhere/dtjob", "dtjob-node-3": ""}
        )
    message = str(refused.value)
    assert (
        "dtjob-node-2 runs /elsewhere/dtjob" in message
        and "dtjob-node-3 runs an unrecorded checkout" in message
    )
    assert "dtjob-node-1" not in message and ours in message and "`dtjob devcluster down`" in message


def test_a_started_node_records_the_checkout_its_pods_run(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    assert nodes.checkout(layout, "dtjob-node-1") == ""
    layout.node_dir("dtjob-node-1").mkdir(parents=True)
    layout.node_checkout_file("dtjob-node-1").write_text(f"{nodes.CHECKOUT}\n")
    assert nodes.checkout(layout, "dtjob-node-1") == str(nodes.CHECKOUT)
    assert str(nodes.CHECKOUT / "trainer_image") in nodes.environment()["PYTHONPATH"].split(os.pathsep)
