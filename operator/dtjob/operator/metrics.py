"""The operator's own Prometheus metrics (served by `dtjob operator --metrics-port`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dtjob import contract
from dtjob.api import JobPhase
from dtjob.operator.actions import JobRecovered, JobRestarted
from dtjob.operator.recoveries import CAUSES
from dtjob.operator.timefmt import from_rfc3339

# The stages of a reconcile pass (the label `stage` of dtjob_operator_reconcile_errors_total).
RECONCILE_STAGES = ("observe", "decide", "act")

PHASES = tuple(phase.value for phase in JobPhase)


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
            "dtjob_operator_rescales",
            "World size changes by direction and reason",
            ["direction", "reason"],
            registry=r,
        )
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
        self._job_metrics()
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        for phase in PHASES:
            self.jobs.labels(phase=phase).set(0)
        # Zero, not absent, until a pass fails: the dashboard's error panel shows 0 on a healthy operator.
        for stage in RECONCILE_STAGES:
            self.reconcile_errors.labels(stage=stage)

    def _job_metrics(self) -> None:
        """The per-job series of contract.JOB_METRICS (#43): labels namespace, name (and cause)."""
        docs = {m.name: m for m in contract.JOB_METRICS}

        def gauge(metric: str) -> Gauge:
            return Gauge(metric, docs[metric].meaning, docs[metric].labels, registry=self.registry)

        self.job_step = gauge("dtjob_job_step")
        self.job_total_steps = gauge("dtjob_job_total_steps")
        self.job_eta = gauge("dtjob_job_eta_seconds")
        self.job_goodput = gauge("dtjob_job_goodput_ratio")
        self.job_tokens = gauge("dtjob_job_tokens_per_second")
        self.job_mfu = gauge("dtjob_job_model_flops_utilization")
        self._job_gauges = (
            self.job_step,
            self.job_total_steps,
            self.job_eta,
            self.job_goodput,
            self.job_tokens,
            self.job_mfu,
        )
        doc = docs["dtjob_job_restarts_total"]  # the client adds _total to a counter's name
        self.job_restarts = Counter(
            doc.name.removesuffix("_total"), doc.meaning, doc.labels, registry=self.registry
        )
        doc = docs["dtjob_job_steps_redone_total"]
        self.job_steps_redone = Counter(
            doc.name.removesuffix("_total"), doc.meaning, doc.labels, registry=self.registry
        )
        doc = docs["dtjob_job_recovery_seconds"]
        # Downtime: a planned rescale takes seconds, a lost node minutes (its NotReady, new pods).
        self.job_recovery_seconds = Histogram(
            doc.name,
            doc.meaning,
            doc.labels,
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
            registry=self.registry,
        )

    def job_recovery(self, namespace: str, name: str, action: JobRestarted | JobRecovered) -> None:
        """A job's gang stopped (JobRestarted) or stepped again (JobRecovered)."""
        if isinstance(action, JobRestarted):
            self.job_restarts.labels(namespace, name, action.cause).inc()
            self.job_steps_redone.labels(namespace, name).inc(action.steps_redone)
        else:
            self.job_recovery_seconds.labels(namespace, name, action.cause).observe(action.seconds)

    def job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """The job's progress, ETA and goodput from its status (as written); a field the status
        lacks removes its series."""
        progress, kept = status.get("progress") or {}, status.get("goodput") or {}
        eta, sample = from_rfc3339(status.get("eta")), kept.get("sample") or {}
        at = from_rfc3339(sample.get("time"))
        left = None if eta is None or at is None else max(0.0, (eta - at).total_seconds())
        values = (
            status.get("step"),
            progress.get("totalSteps"),
            left,
            kept.get("ratio"),
            progress.get("tokensPerSecond"),
            progress.get("modelFlopsUtilization"),
        )
        for gauge, value in zip(self._job_gauges, values, strict=True):
            if value is None:
                _remove(gauge, namespace, name)
            else:
                gauge.labels(namespace, name).set(float(value))

    def forget_job(self, namespace: str, name: str) -> None:
        """The job is gone: its series go too."""
        for gauge in (*self._job_gauges, self.job_steps_redone):
            _remove(gauge, namespace, name)
        for cause in CAUSES:
            _remove(self.job_restarts, namespace, name, cause)
            _remove(self.job_recovery_seconds, namespace, name, cause)

    def job_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """Record a job's phase (None: the job is gone, and its series go) and refresh the
        per-phase gauge."""
        if phase is None:
            self.forget_job(namespace, name)
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


def _remove(metric: Gauge | Counter | Histogram, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # no such series
        metric.remove(*labels)
