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

from dtjob.operator.settings import ObserverSettings, OperatorSettings, ReconcilerSettings, RetrySettings
from dtjob.operator.worker_defaults import WorkerDefaultsError, from_env

DEFAULTS = OperatorSettings()


def parse_args(argv: list[str]) -> argparse.Namespace:
    d, r, o, retry = DEFAULTS, DEFAULTS.reconciler, DEFAULTS.observer, DEFAULTS.retry
    parser = argparse.ArgumentParser(prog="dtjob operator", description=__doc__.splitlines()[0])
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="serve jobs in this namespace (repeatable)")  # fmt: skip
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="serve every namespace (the default without --namespace)")  # fmt: skip
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", default=d.peering, metavar="NAME",
                         help="kopf peering name shared by replicas; one is active")  # fmt: skip
    peering.add_argument(
        "--standalone", action="store_true", help="no peering: this replica is always active"
    )
    parser.add_argument(
        "--priority", type=int, default=d.priority, help="peering priority; the highest one is active"
    )
    parser.add_argument("--liveness", default=d.liveness, metavar="URL",
                        help="liveness endpoint (default %(default)s; 'none' disables)")  # fmt: skip
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port, metavar="PORT",
                        help="port of the operator's /metrics (0: none)")  # fmt: skip
    parser.add_argument("--interval", type=float, default=d.interval_seconds, metavar="SECONDS",
                        help="timer period of a job: a tick reconciles it when a pass is due")  # fmt: skip
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    tuning = parser.add_argument_group("tuning (each flag sets a field of dtjob.operator.settings)")
    for flag, kind, default, text in (
        ("--max-workers", int, d.max_workers, "threads running passes: jobs reconciled at once"),
        ("--resync-seconds", float, d.resync_seconds,
         "reconcile every job at least this often, even when no event nor deadline comes"),
        ("--trigger-delay-seconds", float, d.trigger_delay_seconds,
         "a watched change runs its job's pass this much later, with the changes meanwhile"),
        ("--progress-write-seconds", float, d.progress_write_seconds,
         "a status patch that only moves the workers' progress waits this long after the last one"),
        ("--grow-hold-seconds", float, r.grow_hold_seconds, "a gang runs this long at a size before growing"),
        ("--unplanned-stop-grace-seconds", int, r.unplanned_stop_grace_seconds,
         "SIGTERM-to-SIGKILL grace of the survivors of a failure"),
        ("--metrics-grace-seconds", float, r.metrics_grace_seconds,
         "running time after which a rank 0 serving no metrics means a trainer that publishes none"),
        ("--node-view-lag-seconds", float, r.node_view_lag_seconds,
         "a pod bound after its node's NotReady transition is on a lost node once this long bound"),
        ("--pod-writes-per-pass", int, r.pod_writes_per_pass,
         "pod creations and deletions of one pass; the rest go in the passes right after it"),
        ("--cache-sync-timeout-seconds", float, o.cache_sync_timeout_seconds,
         "a pass waits this long for the caches of pods, nodes and Services to list once"),
        ("--api-concurrency", int, o.api_concurrency, "pod creations and deletions in flight at once"),
        ("--job-write-concurrency", int, o.job_write_concurrency,
         "status patches and other writes to jobs in flight at once"),
        ("--metrics-timeout-seconds", float, o.metrics_timeout_seconds, "timeout of one scrape of rank 0"),
        ("--scrape-workers", int, o.scrape_workers, "threads scraping rank 0 of every job"),
        ("--scrape-interval-seconds", float, o.scrape_interval_seconds,
         "scrape a job's rank 0 at most this often"),
        ("--scrape-backoff-max-seconds", float, o.scrape_backoff_max_seconds,
         "longest wait before asking a silent rank 0 again"),
        ("--log-tail-lines", int, o.log_tail_lines, "lines of a finished worker's log read"),
        ("--log-reads-per-pass", int, o.log_reads_per_pass,
         "logs of workers that exited 76 read per pass to name the lost rank"),
        ("--retry-backoff-seconds", float, retry.backoff_seconds,
         "first retry delay of a failing job; doubled per failure in a row"),
        ("--retry-backoff-max-seconds", float, retry.backoff_max_seconds, "longest retry delay"),
    ):  # fmt: skip
        tuning.add_argument(
            flag, type=kind, default=default, metavar="N", help=f"{text} (default %(default)s)"
        )
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error(f"--interval must be positive, got {args.interval}")
    if not 0 <= args.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    return args


def build_settings(args: argparse.Namespace, env: Mapping[str, str]) -> OperatorSettings:
    """The operator's settings from its flags and environment. ValueError (WorkerDefaultsError
    included) names the setting or variable that is wrong."""
    return OperatorSettings(
        namespaces=tuple(args.namespace),
        peering=None if args.standalone else args.peering,
        priority=args.priority,
        liveness=None if args.liveness == "none" else args.liveness,
        metrics_port=args.metrics_port,
        interval_seconds=args.interval,
        max_workers=args.max_workers,
        trigger_delay_seconds=args.trigger_delay_seconds,
        progress_write_seconds=args.progress_write_seconds,
        resync_seconds=args.resync_seconds,
        verbose=args.verbose,
        reconciler=ReconcilerSettings(
            grow_hold_seconds=args.grow_hold_seconds,
            unplanned_stop_grace_seconds=args.unplanned_stop_grace_seconds,
            metrics_grace_seconds=args.metrics_grace_seconds,
            node_view_lag_seconds=args.node_view_lag_seconds,
            pod_writes_per_pass=args.pod_writes_per_pass,
            workers=from_env(env),
        ),
        observer=ObserverSettings(
            cache_sync_timeout_seconds=args.cache_sync_timeout_seconds,
            api_concurrency=args.api_concurrency,
            job_write_concurrency=args.job_write_concurrency,
            metrics_timeout_seconds=args.metrics_timeout_seconds,
            scrape_workers=args.scrape_workers,
            scrape_interval_seconds=args.scrape_interval_seconds,
            scrape_backoff_max_seconds=args.scrape_backoff_max_seconds,
            log_tail_lines=args.log_tail_lines,
            log_reads_per_pass=args.log_reads_per_pass,
        ),
        retry=RetrySettings(
            backoff_seconds=args.retry_backoff_seconds, backoff_max_seconds=args.retry_backoff_max_seconds
        ),
    )


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
        "serving %s, peering %s", "all namespaces" if clusterwide else ", ".join(settings.namespaces),
        settings.peering or "off",
    )  # fmt: skip
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
