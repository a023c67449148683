"""`dtjob operator`: run the operator (kopf underneath).

dtjob operator [--namespace NS ...| --all-namespaces] [--peering NAME | --standalone]
               [--liveness URL] [--metrics-port PORT] [--interval SECONDS]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Port of the operator's own /metrics; the trainer's is 9400 inside each pod's namespace.
DEFAULT_METRICS_PORT = 9401
DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"
# The timer reconciles every job this often even when nothing happens, to read the trainer's step
# and to notice deadlines, TTLs and lost nodes (node events are not watched: a node turns NotReady
# only after its lease expires, tens of seconds, so 5 s more do not matter).
DEFAULT_INTERVAL_SECONDS = 5.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dtjob operator", description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="serve jobs in this namespace (repeatable)")  # fmt: skip
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="serve every namespace (the default without --namespace)")  # fmt: skip
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", default="dtjob", metavar="NAME",
                         help="kopf peering name shared by replicas; one is active")  # fmt: skip
    peering.add_argument(
        "--standalone", action="store_true", help="no peering: this replica is always active"
    )
    parser.add_argument("--priority", type=int, default=0, help="peering priority; the highest one is active")
    parser.add_argument("--liveness", default=DEFAULT_LIVENESS, metavar="URL",
                        help=f"liveness endpoint (default {DEFAULT_LIVENESS}; 'none' disables)")  # fmt: skip
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT, metavar="PORT",
                        help="port of the operator's /metrics (0: none)")  # fmt: skip
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_SECONDS, metavar="SECONDS",
                        help="reconcile every job at least this often")  # fmt: skip
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error(f"--interval must be positive, got {args.interval}")
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # kopf logs every handler call at INFO; ours say what changed.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("urllib3").setLevel(logging.ERROR)
    # kopf, kubernetes and prometheus-client are the [operator] extra: imported only here.
    import kopf
    from prometheus_client import start_http_server

    from dtjob.operator import worker_defaults
    from dtjob.operator.handlers import JobReconciler, build_registry
    from dtjob.operator.kube import Kube, load_config
    from dtjob.operator.metrics import OperatorMetrics
    from dtjob.operator.peering import ensure_peering

    clusterwide = not args.namespace
    # Worker-pod defaults from the installer (the helm chart's `workers.*` values).
    try:
        worker_defaults.configure(worker_defaults.from_env(os.environ))
    except worker_defaults.WorkerDefaultsError as e:
        print(f"dtjob operator: {e}", file=sys.stderr)
        return 2
    load_config()
    if not args.standalone:
        ensure_peering(args.peering, clusterwide, args.namespace)
    metrics = OperatorMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    reconciler = JobReconciler(Kube(metrics), metrics)
    registry = build_registry(reconciler, args.interval)
    logging.getLogger("dtjob.operator").info(
        "serving %s, peering %s", "all namespaces" if clusterwide else ", ".join(args.namespace),
        "off" if args.standalone else args.peering,
    )  # fmt: skip
    kopf.run(
        registry=registry,
        clusterwide=clusterwide,
        namespaces=args.namespace,
        standalone=args.standalone or None,
        peering_name=None if args.standalone else args.peering,
        priority=args.priority,
        liveness_endpoint=None if args.liveness == "none" else args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
