"""The operator's settings: frozen dataclasses, built once at start and passed down.

`dtjob operator` builds one `OperatorSettings` from its flags and environment (the helm chart
turns its values into both; see `dtjob.operator.main.build_settings`) and hands each part to what
uses it: `reconciler` goes into every call of the pure reconciler beside the observation,
`observer` to the Kubernetes client, `retry` to the pass runner, the rest to kopf. Nothing reads
a setting from a module constant or a process global, so a test builds the settings it needs.

Each field is documented in the docstring under it, as kopf documents its `OperatorSettings`,
and is a flag of `dtjob operator` (dtjob.operator.flags derives each flag's name, type, default
and help from the field: a new setting needs no flag declared).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dtjob.operator.worker_defaults import WorkerDefaults


def _check_positive(settings: object, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if not value > 0:
            raise ValueError(f"{type(settings).__name__}.{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class ReconcilerSettings:
    """What the pure reconciler reads besides the observation."""

    grow_hold_seconds: float = 5.0
    """A gang must have run this long at its size before it grows, so a capacity estimate the
    scheduler disagrees with cannot make the job flap faster than this."""

    unplanned_stop_grace_seconds: int = 5
    """SIGTERM-to-SIGKILL grace of the survivors after a failure. They cannot checkpoint (a sharded
    checkpoint needs every rank, and a peer is gone), and a trainer blocked in a collective with a
    dead peer would use up the pod's whole grace period."""

    metrics_grace_seconds: float = 30.0
    """How long a running generation's rank 0 may serve no dtjob metrics before the operator
    concludes that the trainer publishes none (condition MetricsAvailable=False) and stops
    waiting for a checkpoint before planned rescales. 30 s covers the dtjob trainer's start
    (importing torch takes up to ~15 s on a loaded 2-core node): a start, not a silence, so it is
    no multiple of the job's heartbeat timeout T (dtjob/liveness_table.py)."""

    node_view_lag_seconds: float = 10.0
    """A pod bound to a node after the NotReady transition in the operator's view of that node is
    taken as bound to a node that came back (the view lags: a gang waiting for a returning node is
    bound to it within a second) for this long after its binding; past it, the view would show the
    node Ready, so the node is lost after all (a scheduler can bind to a node in the moment between
    its NotReady transition and its NoSchedule taint) and the pod is force-deleted."""

    pod_writes_per_pass: int = 96
    """Pod creations and deletions one pass sends at most, and a job has at most twice this many
    in flight; a pass with more to do leaves the rest to the next pass, which runs once the job
    has at most this many in flight and sees the first ones (as the expectations of the writes in
    flight, or in the cache once answered). 96 are about 0.7 s of writes (137 pods a second on
    KWOK through 32 writes in flight), so nothing else of the job waits long; all 1,024 of a large
    gang in one pass are 7.5 s. The bound in flight keeps the passes that the gang's own pod events
    trigger from queueing all 1,024 ahead of every other job's writes (p99 wait for the pool 9.6 s
    without it; bench/README.md, "A bounded number of pod writes per pass")."""

    workers: WorkerDefaults = field(default_factory=WorkerDefaults)
    """Site-wide defaults of the worker pods (the chart's `workers.*` values); a job's template
    wins over each of them."""

    def __post_init__(self) -> None:
        _check_positive(
            self, "grow_hold_seconds", "metrics_grace_seconds", "node_view_lag_seconds", "pod_writes_per_pass"
        )
        if self.unplanned_stop_grace_seconds < 0:
            raise ValueError(
                "ReconcilerSettings.unplanned_stop_grace_seconds must be >= 0, "
                f"got {self.unplanned_stop_grace_seconds!r}"
            )


@dataclass(frozen=True)
class ObserverSettings:
    """How the Kubernetes client observes a job's world and acts on it."""

    cache_sync_timeout_seconds: float = 30.0
    """How long a pass waits for the operator's caches of pods, nodes and Services to list their
    resource once (at start, or after a lost watch); past it the pass fails with ObserveFailed
    and is retried with backoff."""

    api_concurrency: int = 32
    """Pod creations and deletions (and events) in flight at once, over all jobs: a 1,024-worker
    gang is created in 32 waves instead of one request after the other, and the API server never
    sees more than this many of the operator's pod writes at a time."""

    job_write_concurrency: int = 16
    """Status patches (with a pass's other writes to the job's own objects: its Service, PodGroup,
    its deletion) in flight at once, over all jobs; one per job at a time. A pool apart from the
    pod writes', so a job's status never waits behind another job's 1,024 pod creations, and the
    jobs already started go first; a new job is admitted while no more than `api_concurrency`
    pod writes wait for a thread (dtjob.operator.writer). 500 jobs created at once queued their
    first status patches for up to 29 s (p99) on 16 first-come threads; on 32
    they waited 10 s, but the API server answered everyone slower and the 500 jobs were all
    Running later (72 and 97 s against 57 s, one run each, bench/README.md)."""

    metrics_timeout_seconds: float = 1.0
    """Timeout of one scrape of rank 0's metrics endpoint (scrapes run in the background; no
    pass waits for one)."""

    scrape_workers: int = 32
    """Threads scraping rank 0 of every job, each scrape bounded by metrics_timeout_seconds."""

    scrape_interval_seconds: float = 1.0
    """A job's rank 0 is scraped at most this often (a pass in between reuses the last answer).
    The scrape reads progress and finds no failure, so none of its times is a multiple of the
    job's heartbeat timeout T (dtjob/liveness_table.py)."""

    scrape_backoff_max_seconds: float = 8.0
    """A rank 0 that does not answer is asked again after 1 s, doubling up to this."""

    log_tail_lines: int = 20
    """Lines of a finished worker's log read for its closing line or its reason to exit."""

    log_reads_per_pass: int = 8
    """Logs of workers that exited 76 (a lost peer) read per pass to name the lost rank: when a
    whole 1,024-worker gang exits 76, a few name it as well as all of them."""

    def __post_init__(self) -> None:
        _check_positive(
            self,
            "cache_sync_timeout_seconds",
            "api_concurrency",
            "job_write_concurrency",
            "metrics_timeout_seconds",
            "scrape_workers",
            "scrape_interval_seconds",
            "scrape_backoff_max_seconds",
            "log_tail_lines",
            "log_reads_per_pass",
        )


@dataclass(frozen=True)
class RetrySettings:
    """Backoff of a job whose pass failed (an exception while observing, deciding or acting)."""

    backoff_seconds: float = 1.0
    """Delay before the first retry; each further failure in a row doubles it."""

    backoff_max_seconds: float = 30.0
    """Longest delay between two retries of a failing job."""

    def delay(self, failures: int) -> float:
        """Seconds before the retry after `failures` failed passes in a row (1, 2, ...)."""
        return float(min(self.backoff_max_seconds, self.backoff_seconds * 2 ** max(0, failures - 1)))

    def __post_init__(self) -> None:
        _check_positive(self, "backoff_seconds", "backoff_max_seconds")
        if self.backoff_max_seconds < self.backoff_seconds:
            raise ValueError(
                f"RetrySettings.backoff_max_seconds ({self.backoff_max_seconds}) must be >= "
                f"backoff_seconds ({self.backoff_seconds})"
            )


@dataclass(frozen=True)
class OperatorSettings:
    """Everything `dtjob operator` is configured with."""

    namespaces: tuple[str, ...] = ()
    """Namespaces served; empty: every namespace."""

    peering: str | None = "dtjob"
    """kopf peering name shared by replicas (one is active); None: standalone, always active."""

    priority: int = 0
    """Peering priority: of operators sharing a peering object, the highest works."""

    liveness: str | None = "http://0.0.0.0:8080/healthz"
    """Liveness endpoint URL served by kopf; None: none."""

    metrics_port: int = 9401
    """Port of the operator's own /metrics; 0: none. The trainer's is 9400 inside each pod."""

    interval_seconds: float = 5.0
    """kopf's timer period per job. A tick runs a pass only when one is due: a deadline, TTL,
    hold or grace period the last pass named (those also get a pass of their own at that
    moment), resync_seconds since the last pass, or, while the job waits on what no watch
    announces (capacity freed by other jobs, a Volcano queue), every tick. Pod changes, nodes
    turning NotReady, spec changes and rank 0's new steps trigger a pass at once."""

    resync_seconds: float = 60.0
    """Every job is reconciled at least this often even when nothing happens: the safety net
    under the watches and the plan's wake-ups. 200 running jobs at 60 s cost 3 passes a
    second, against 40 when every 5 s tick ran one."""

    max_workers: int = 16
    """Threads running passes: one pass per job at a time, this many jobs at once."""

    trigger_delay_seconds: float = 0.2
    """Every trigger of a job (its timer, its events, a change of its pods or nodes, rank 0's new
    step) runs its pass this long later, and every further trigger of the job meanwhile joins
    that pass: a gang's pods change within milliseconds of each other at every stage (created,
    bound, running), and each pass that sees one writes the job's status, whose event is one
    more trigger. 200 jobs of 4 workers on KWOK: 2,090 passes and 710 status patches with it,
    6,112 and 1,489 at 0 (bench/README.md). 0: at once. A worker failing and the last pod of
    a generation going away skip it: each decides its pass alone (restart; create the next
    generation)."""

    progress_write_seconds: float = 10.0
    """A job's status patch that only moves its workers' progress (readyReplicas, the count in
    its Waiting message; neither is a printer column) is written at most this long after the
    job's previous status patch; the pass that decides it runs again then. Every other status
    change (a phase, a generation, a new reason to wait) is written at once. 500 jobs of 4
    workers created at once: each pod scheduled or running was a patch of its own, 2,800-2,900 in
    all against 1,800 when passes waited for their pod writes, and status writes waited up to
    30 s for the API server (bench/README.md); 1 s saved 170 of them, 5 s 530 (one run each).
    0: at once."""

    verbose: bool = False
    """Debug logging (every API call and kopf handler)."""

    reconciler: ReconcilerSettings = field(default_factory=ReconcilerSettings)
    """Given to the pure reconciler with each observation."""

    observer: ObserverSettings = field(default_factory=ObserverSettings)
    """Given to the Kubernetes client."""

    retry: RetrySettings = field(default_factory=RetrySettings)
    """Backoff of failing passes."""

    def __post_init__(self) -> None:
        _check_positive(self, "interval_seconds", "max_workers")
        if self.resync_seconds < self.interval_seconds:
            raise ValueError(
                f"OperatorSettings.resync_seconds ({self.resync_seconds}) must be >= interval_seconds "
                f"({self.interval_seconds}): the timer's tick is what runs the resync"
            )
        if self.progress_write_seconds < 0:
            raise ValueError(
                f"OperatorSettings.progress_write_seconds must be >= 0, got {self.progress_write_seconds!r}"
            )
        if self.trigger_delay_seconds < 0:
            raise ValueError(
                f"OperatorSettings.trigger_delay_seconds must be >= 0, got {self.trigger_delay_seconds!r}"
            )
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"OperatorSettings.metrics_port must be in 0..65535, got {self.metrics_port}")
