"""`dtjob operator`: run the operator (kopf underneath).

dtjob operator [--namespace NS ...| --all-namespaces] [--peering NAME | --standalone]
               [--liveness URL] [--metrics-port PORT] [--interval SECONDS] [tuning flags]

The flags (and the DTJOB_WORKER_* environment the helm chart sets) become one `OperatorSettings`
(`build_settings`); see dtjob.operator.settings for what each setting does.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping

from dtjob.operator import flags
from dtjob.operator.settings import OperatorSettings
from dtjob.operator.worker_defaults import WorkerDefaultsError


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags: one per settings field (dtjob.operator.flags); exits 2 naming a bad one."""
    parser = flags.parser(prog="dtjob operator", description=__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error(f"--interval must be positive, got {args.interval}")
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    return args


def build_settings(args: argparse.Namespace, env: Mapping[str, str]) -> OperatorSettings:
    """The operator's settings from its flags and environment. ValueError (WorkerDefaultsError
    included) names the setting or variable that is wrong."""
    built: OperatorSettings = flags.settings(args, env)
    return built


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        settings = build_settings(args, os.environ)
    except (WorkerDefaultsError, ValueError) as e:
        print(f"dtjob operator: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if settings.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not settings.verbose:
        # kopf logs every handler call at INFO; ours say what changed.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("urllib3").setLevel(logging.ERROR)
    # kopf, kubernetes and prometheus-client are the [operator] extra: imported only here.
    import kopf
    from prometheus_client import start_http_server

    from dtjob.operator.handlers import build_registry
    from dtjob.operator.jobview import FINALIZER
    from dtjob.operator.kube import Kube, load_config
    from dtjob.operator.metrics import OperatorMetrics
    from dtjob.operator.passes import JobPassRunner
    from dtjob.operator.peering import ensure_peering

    clusterwide = not settings.namespaces
    load_config()
    if settings.peering is not None:
        ensure_peering(settings.peering, clusterwide, list(settings.namespaces))
    metrics = OperatorMetrics()
    if settings.metrics_port:
        start_http_server(settings.metrics_port, registry=metrics.registry)
    kube = Kube(metrics, settings.observer, settings.namespaces)
    runner = JobPassRunner(kube, metrics, settings, finalizer=FINALIZER)
    # Pod and node changes come from the operator's own watches (dtjob.operator.cache), rank 0's
    # new steps from its scraper: both trigger passes from their threads without waiting on them.
    kube.start(runner.trigger_soon)
    registry = build_registry(runner, settings)
    logging.getLogger("dtjob.operator").info(
        "serving %s, peering %s",
        "all namespaces" if clusterwide else ", ".join(settings.namespaces),
        settings.peering or "off",
    )
    kopf.run(
        registry=registry,
        clusterwide=clusterwide,
        namespaces=list(settings.namespaces),
        standalone=settings.peering is None or None,
        peering_name=settings.peering,
        priority=settings.priority,
        liveness_endpoint=settings.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
