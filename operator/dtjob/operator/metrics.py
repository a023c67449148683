"""The operator's own Prometheus metrics (served by `dtjob operator --metrics-port`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PHASES = ("Pending", "Running", "Restarting", "Succeeded", "Failed", "Suspended")


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.jobs = Gauge("dtjob_operator_jobs", "DistributedTrainingJobs by phase", ["phase"], registry=r)
        self.restarts = Counter(
            "dtjob_operator_gang_restarts", "Unplanned gang restarts by reason", ["reason"], registry=r
        )
        self.rescales = Counter(
            "dtjob_operator_rescales", "World size changes by direction and reason", ["direction", "reason"],
            registry=r,
        )  # fmt: skip
        # Seconds, finer than the client's default buckets around 1 s: observing a 1,024-worker
        # gang and deciding takes 0.1-0.4 s, every other pass milliseconds.
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)
        self.reconcile_seconds = Histogram(
            "dtjob_operator_reconcile_duration_seconds",
            "Time to observe one job, decide and hand the writes over (their answers are in "
            "dtjob_operator_write_duration_seconds)",
            buckets=buckets,
            registry=r,
        )
        # The same buckets: a write's time is the API server's answer plus its wait for a free
        # thread of its pool (a 1,024-worker gang's pod writes queue for seconds).
        self.write_seconds = Histogram(
            "dtjob_operator_write_duration_seconds",
            "From a pass handing a write over to its answer, by write: status, create_pod, "
            "delete_pod, event, other (the job's Service, PodGroup, deletion)",
            ["write"],
            buckets=buckets,
            registry=r,
        )
        self.api_requests = Counter(
            "dtjob_operator_api_requests",
            "Requests of the operator's Kubernetes client by verb and resource (kopf's own, its "
            "watch of the jobs and its finalizer patches, are not counted)",
            ["verb", "resource"],
            registry=r,
        )
        self.reconcile_errors = Counter(
            "dtjob_operator_reconcile_errors",
            "Failed passes by stage (observe, decide, act); each is retried with backoff",
            ["stage"],
            registry=r,
        )
        # Seconds: a gang restart waits for SIGTERM grace and a new rendezvous, so 1 s .. 10 min.
        self.recovery_seconds = Histogram(
            "dtjob_operator_time_to_recover_seconds",
            "From a failure seen to the next generation running",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=r,
        )
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Record a job's phase (None: the job is gone) and refresh the per-phase gauge."""
        with self._lock:
            if phase is None:
                self._phases.pop((namespace, name), None)
            else:
                self._phases[(namespace, name)] = phase
            counts = dict.fromkeys(PHASES, 0)
            for p in self._phases.values():
                counts[p] = counts.get(p, 0) + 1
            for p, n in counts.items():
                self.jobs.labels(phase=p).set(n)
