"""`dtjob devcluster up | down | status | env | node stop|start NAME | net down|up POD [-n NS]`."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from dtjob.devcluster import cluster
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.layout import CONTROL_PLANE, Layout, node_index

# Kubernetes quantities the nodelet advertises as capacity: cpus like 4 or 500m, memory like 8Gi.
CPU_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?m?$")
MEMORY_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")


def _quantity(pattern: re.Pattern[str], example: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not pattern.match(text):
            raise argparse.ArgumentTypeError(f"{text!r} is not a Kubernetes quantity like {example}")
        return text

    return parse


def _node_name(text: str) -> str:
    try:
        node_index(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dtjob devcluster",
        description="A local Kubernetes cluster: upstream etcd, kube-apiserver, kube-controller-manager "
        "and kube-scheduler, and dtjob nodelets. State lives in $DTJOB_DEVCLUSTER_DIR "
        "(default /var/tmp/dtjob-devcluster).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    defaults = cluster.ClusterConfig()
    up = sub.add_parser("up", help="start the cluster (or what of it is not running) and wait until Ready")
    up.add_argument("--nodes", type=int, help=f"number of nodes (default {defaults.nodes})")
    up.add_argument(
        "--gpus-per-node", type=int, help=f"nvidia.com/gpu per node (default {defaults.gpus_per_node})"
    )
    up.add_argument(
        "--cpus-per-node", type=_quantity(CPU_QUANTITY, "4 or 500m"), help=f"default {defaults.cpus_per_node}"
    )
    up.add_argument(
        "--memory-per-node",
        type=_quantity(MEMORY_QUANTITY, "8Gi"),
        help=f"default {defaults.memory_per_node}",
    )
    up.add_argument(
        "--fake-nodes",
        type=int,
        help="simulated nodes dtjob-kwok-<i> run by KWOK (built on first use, ~7 min): pods that tolerate "
        "their taint kwok.x-k8s.io/node=fake:NoSchedule go Running without running anything; "
        "changes the number on a running cluster, 0 removes them (default 0)",
    )
    up.add_argument(
        "--fake-gpus-per-node",
        type=int,
        help=f"nvidia.com/gpu per simulated node (default {defaults.fake_gpus_per_node}; "
        f"cpu {defaults.fake_cpus_per_node}, memory {defaults.fake_memory_per_node}, "
        f"{defaults.fake_pods_per_node} pods)",
    )
    up.add_argument(
        "--volcano",
        action="store_true",
        default=None,
        help="also run Volcano's scheduler and controller manager (built from its release source "
        "on first use, ~10 min; see DTJOB_VOLCANO_TARBALL in devcluster/README.md) with its CRDs "
        "and the default queue; adds them to a running cluster",
    )
    up.add_argument(
        "--prometheus",
        action="store_true",
        default=None,
        help="also run Prometheus on 127.0.0.1:9090 (built from its Go modules on first use) with "
        "the Helm chart's scrape jobs (helm/dtjob/prometheus/scrape-configs.yaml): the operator's "
        "pod and every worker pod, found by Kubernetes service discovery; adds it to a running cluster",
    )
    sub.add_parser("down", help="stop everything and remove processes, network and mounts")
    sub.add_parser("status", help="show components and nodes; exit 1 unless all are healthy")
    sub.add_parser("env", help='print shell exports: eval "$(dtjob devcluster env)"')
    node = sub.add_parser("node", help="simulate node loss: node stop NAME, node start NAME")
    node.add_argument("action", choices=["stop", "start"])
    node.add_argument("name", type=_node_name, help="dtjob-node-<N>")
    net = sub.add_parser(
        "net",
        help="cut one pod off the network (net down POD: the host end of its veth down; its processes "
        "keep running) or connect it again (net up POD)",
    )
    net.add_argument("action", choices=["down", "up"])
    net.add_argument("pod", help="pod name")
    net.add_argument("-n", "--namespace", default="default", help="the pod's namespace (default: default)")
    restart = sub.add_parser(
        "restart", help="simulate a control-plane failure: SIGKILL one component, start it again"
    )
    restart.add_argument("component", choices=CONTROL_PLANE)
    restart.add_argument(
        "--down", type=float, default=0.0, metavar="SECONDS", help="how long it stays down (default 0)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    layout = Layout.from_env()
    try:
        if args.command == "up":
            requested = {
                "nodes": args.nodes,
                "gpus_per_node": args.gpus_per_node,
                "cpus_per_node": args.cpus_per_node,
                "memory_per_node": args.memory_per_node,
                "fake_nodes": args.fake_nodes,
                "fake_gpus_per_node": args.fake_gpus_per_node,
                "volcano": args.volcano,
                "prometheus": args.prometheus,
            }
            return cluster.up(layout, requested)
        if args.command == "down":
            return cluster.down(layout)
        if args.command == "status":
            return cluster.status(layout)
        if args.command == "env":
            return cluster.env(layout)
        if args.command == "restart":
            return cluster.restart(layout, args.component, args.down)
        if args.command == "net":
            return cluster.pod_network(layout, args.namespace, args.pod, up=args.action == "up")
        if args.action == "stop":
            return cluster.node_stop(layout, args.name)
        return cluster.node_start(layout, args.name)
    except DevclusterError as e:
        print(f"devcluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("devcluster: interrupted; run `dtjob devcluster down` to clean up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
