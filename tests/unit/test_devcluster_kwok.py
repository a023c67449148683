"""Simulated nodes (KWOK) in the devcluster, without a cluster: the command line, the Node objects,
the shape checks, and `up --fake-nodes` without Go."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

import pytest

from dtjob.devcluster import controlplane, kwok
from dtjob.devcluster.binaries import Binaries, read_versions
from dtjob.devcluster.cluster import ClusterConfig
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.layout import BRIDGE_ADDRESS, POD_NETWORK, Layout, pod_cidr
from dtjob.operator.capacity import node_admits
from tests.unit.test_devcluster import _devcluster


def test_simulated_pods_get_ips_inside_the_pod_network_away_from_every_nodelet() -> None:
    fake = ipaddress.IPv4Network(kwok.FAKE_POD_CIDR)
    assert fake.subnet_of(ipaddress.IPv4Network(POD_NETWORK))
    assert fake.num_addresses >= 1024 + 500 * 4, "a 1,024-worker gang and 500 jobs of 4 at once"
    nodelets = [ipaddress.IPv4Network(pod_cidr(i)) for i in range(1, kwok.MAX_NODELETS_BESIDE + 1)]
    assert not any(n.overlaps(fake) for n in nodelets)
    assert ipaddress.IPv4Network(pod_cidr(kwok.MAX_NODELETS_BESIDE + 1)).overlaps(fake)
    kwok.check_shape(kwok.MAX_NODELETS_BESIDE)
    with pytest.raises(DevclusterError, match="--nodes <= 191"):
        kwok.check_shape(kwok.MAX_NODELETS_BESIDE + 1)


def test_kwok_command_manages_only_annotated_nodes_with_the_safe_cidr(tmp_path: Path) -> None:
    argv = kwok.command(Layout(tmp_path), tmp_path / "kwok.yaml")
    v = read_versions()
    assert argv[0].endswith(f"kwok-v{v['KWOK_VERSION']}-p{v['KWOK_PATCH']}/kwok")
    assert f"--cidr={kwok.FAKE_POD_CIDR}" in argv
    assert "--manage-all-nodes=false" in argv
    assert "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake" in argv
    assert f"--kubeconfig={tmp_path}/admin.kubeconfig" in argv, (
        "the state directory marks it as the cluster's"
    )
    assert f"--server-address=127.0.0.1:{kwok.SERVER_PORT}" in argv


def test_a_simulated_node_offers_its_shape_and_only_tolerating_pods_may_use_it() -> None:
    node = kwok.node_manifest("dtjob-kwok-1", gpus=8, cpus="64", memory="512Gi", pods=110)
    assert node["metadata"]["annotations"][kwok.ANNOTATION] == kwok.ANNOTATION_VALUE
    assert node["status"]["allocatable"] == {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "nvidia.com/gpu": "8",
    }
    assert node["status"]["addresses"][0] == {"type": "InternalIP", "address": BRIDGE_ADDRESS}
    plain = {"spec": {"containers": [{"name": "trainer"}]}}
    simulated = {
        "spec": {
            "containers": [{"name": "trainer"}],
            "tolerations": [kwok.TOLERATION],
            "nodeSelector": dict(kwok.NODE_SELECTOR),
        }
    }
    assert not node_admits(plain, node), "the taint keeps the real nodes' pods off"
    assert node_admits(simulated, node)


def test_fake_node_settings_default_to_none_and_gpu_nodes_of_eight() -> None:
    config = ClusterConfig()
    assert (config.fake_nodes, config.fake_gpus_per_node) == (0, 8)
    # cluster.json written before simulated nodes existed still loads
    assert ClusterConfig(**{"nodes": 3, "gpus_per_node": 2, "cpus_per_node": "4", "memory_per_node": "8Gi"})


def test_the_scheduler_and_controller_manager_may_bind_a_large_gang_quickly(tmp_path: Path) -> None:
    layout, binaries = Layout(tmp_path), Binaries.pinned()
    scheduler = controlplane.command("kube-scheduler", layout, binaries)
    assert f"--kube-api-qps={controlplane.SCHEDULER_QPS}" in scheduler and controlplane.SCHEDULER_QPS >= 500
    manager = controlplane.command("kube-controller-manager", layout, binaries)
    assert f"--kube-api-qps={controlplane.CONTROLLER_MANAGER_QPS}" in manager


def test_up_with_fake_nodes_without_go_and_without_kwok_says_what_to_install(tmp_path: Path) -> None:
    python_only = str(Path(sys.executable).parent) + ":/usr/sbin:/usr/bin:/bin"
    result = _devcluster(
        "up",
        "--fake-nodes",
        "4",
        DTJOB_CACHE=str(tmp_path / "cache"),
        DTJOB_DEVCLUSTER_DIR=str(tmp_path / "dc"),
        PATH=python_only,
    )
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert "KWOK v0.8.0 is not cached" in line and "install Go" in line
    assert not (tmp_path / "dc" / "pki").exists()


def test_negative_fake_nodes_are_refused(tmp_path: Path) -> None:
    result = _devcluster("up", "--fake-nodes", "-1", DTJOB_DEVCLUSTER_DIR=str(tmp_path / "dc"))
    assert result.returncode == 1 and "--fake-nodes" in result.stderr
