"""The operator's Kubernetes client: observe a job's world, execute the reconciler's actions.

Synchronous calls (the kubernetes client) on threads: a pass's actions go to the writer
(dtjob.operator.writer, `submit`), which calls them on its pools; `execute` carries actions out
and waits (the runner's reports on a job). Every write here is idempotent under retries: creates
tolerate AlreadyExists, deletes tolerate NotFound.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, cast
from urllib.parse import urlsplit

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from dtjob import contract
from dtjob.api import JobPhase
from dtjob.operator import gang, ownership
from dtjob.operator.actions import (
    Action,
    ApplyPodGroup,
    CountRescale,
    CountRestart,
    CreatePod,
    CreateService,
    DeleteJob,
    DeletePod,
    EmitEvent,
    JobRecovered,
    JobRestarted,
    ObserveRecovery,
    PatchStatus,
)
from dtjob.operator.cache import ClusterCache, Trigger
from dtjob.operator.expectations import Key, overlay
from dtjob.operator.jobview import API_VERSION, GROUP, KIND, PLURAL, VERSION, JobView
from dtjob.operator.manifests import PODGROUP_API_VERSION
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.nodes import silent_deletion
from dtjob.operator.observed import Observed, WorkerCache
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.rawapi import RawApi, quoted
from dtjob.operator.scrape import Scraper, ScrapeTarget
from dtjob.operator.settings import ObserverSettings
from dtjob.operator.writer import ActionFailed, JobChanged, JobWriter, Outcome, log_pod_writes

log = logging.getLogger("dtjob.operator")
PODGROUP_GROUP, PODGROUP_VERSION = PODGROUP_API_VERSION.split("/")
PODGROUP_PLURAL = "podgroups"
QUEUE_PLURAL = "queues"
# Where every kubelet keeps its node's Lease (the node controller's heartbeat).
NODE_LEASE_NAMESPACE = "kube-node-lease"
# Node Leases one pass reads at once (Observed.leases).
LEASE_READS = 16
# The queue of a PodGroup that names none (vc-scheduler's --default-queue).
DEFAULT_QUEUE = "default"


def load_config() -> None:
    """In-cluster service account when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def _dict(api: client.ApiClient, obj: Any) -> dict[str, Any]:
    return cast(dict[str, Any], api.sanitize_for_serialization(obj))


def final_state_from_log(text: str) -> TrainerProgress | None:
    """The final step (and last checkpoint) in a finished trainer's log: its closing "training
    complete at step N; last checkpoint step M at T" line, else its last per-step JSON line."""
    completion = contract.parse_complete_line(text)
    if completion is not None:
        return TrainerProgress(completion.step, completion.checkpoint_step, completion.checkpoint_time)
    lines = [line.strip() for line in reversed(text.splitlines())]
    for line in lines:
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                return TrainerProgress(step=int(record["step"]))
    return None


class Kube:
    """One client for the whole operator: caches for what passes read (dtjob.operator.cache), a
    background scraper of rank 0 (dtjob.operator.scrape), and a bounded pool for pod writes."""

    def __init__(
        self, metrics: OperatorMetrics, settings: ObserverSettings, namespaces: tuple[str, ...] = ()
    ) -> None:
        self.settings = settings
        configuration = client.Configuration.get_default_copy()
        # Every pod write of the pool may hold a connection at once, beside the watches and the
        # passes' own reads; urllib3's default pool keeps 5 per CPU, and a request past it opens
        # (and then drops) a connection of its own.
        configuration.connection_pool_maxsize = (
            settings.api_concurrency + settings.job_write_concurrency + LEASE_READS + 16
        )
        self.api = client.ApiClient(configuration)
        _count_requests(self.api, metrics)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.raw = RawApi(self.api)
        self.metrics = metrics
        self.cache = ClusterCache(self.raw, namespaces)
        self._reads = ThreadPoolExecutor(LEASE_READS, thread_name_prefix="kube-read")
        # The resourceVersion of each job's last status patch, as the API server answered it.
        self.written: dict[Key, str] = {}
        self.scraper = Scraper(settings)
        # Worker pods parsed once per version, for every pass's Observed and this client's reads.
        self.workers = WorkerCache()
        self.writer = JobWriter(
            head=self._execute_one,
            pod=self._pod_write,
            event=self._event,
            head_concurrency=settings.job_write_concurrency,
            pod_concurrency=settings.api_concurrency,
            observe=lambda kind, seconds: metrics.write_seconds.labels(write=kind).observe(seconds),
        )
        expectations = self.writer.expectations
        self.cache.creating = lambda namespace, job, pod: expectations.creating((namespace, job), pod)

    def start(self, trigger: Trigger) -> None:
        """Starts the caches' watches; `trigger(namespace, name, urgent)` is called (from their
        threads) for every job whose pods changed, whose node was lost, or whose rank 0 said
        something new."""
        self.scraper.on_change = trigger
        self.cache.start(trigger)

    def forget(self, namespace: str, name: str) -> None:
        self.scraper.forget((namespace, name))
        self.written.pop((namespace, name), None)
        self.writer.forget((namespace, name))

    # observing ----------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str, fresh: bool = False) -> dict[str, Any] | None:
        """The job, with the status the last pass wrote: from the cache, which holds every status
        patch's response (see dtjob.operator.cache), or read from the API server when the cache
        does not hold the job yet or `fresh` asks for it. A copy: the pass may keep it while the
        cache moves on."""
        cached = None if fresh else self.cache.job(namespace, name)
        if cached is not None:
            return copy.deepcopy(cached)
        try:
            job = cast(
                dict[str, Any],
                self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name),
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        self.cache.assume_job(copy.deepcopy(job))
        return job

    def observe(self, job: dict[str, Any]) -> Observed:
        self.cache.wait_synced(self.settings.cache_sync_timeout_seconds)
        view = JobView(job)
        now = datetime.now(UTC)
        # The writes in flight before the cache: a write answered in between is in the cache then.
        pending = self.writer.expectations.pending((view.namespace, view.name))
        cached = self.cache.job_pods(view.namespace, view.name)
        # Only pods this job controls (a same-named predecessor's pods are left to the GC).
        pods = [p for p in overlay(cached, pending, now) if _controlled_by(p, view.uid)]
        # An invalid spec is reported by the reconciler; observing must not trip over it first.
        spec_ok = not view.spec_errors
        podgroup = self._get_podgroup(view) if spec_ok and view.uses_podgroup else None
        queue, queue_missing = self._get_queue(view) if podgroup is not None else (None, False)
        return Observed(
            job=job,
            pods=pods,
            nodes=self.cache.node_list(),
            now=now,
            node_pods=self.cache.bound_pods(),
            service_exists=self.cache.service_exists(view.namespace, view.name),
            podgroup=podgroup,
            progress=self._progress(view, pods) if spec_ok else None,
            worker_logs=self._failed_worker_logs(view, pods),
            queue=queue,
            queue_missing=queue_missing,
            leases=self._leases(view, pods),
            pod_writes_in_flight=sum(len(writes) for writes in pending.values()),
            checkpoint_claims=self._checkpoint_claims(job),
            worker_cache=self.workers,
        )

    def _checkpoint_claims(self, job: dict[str, Any]) -> list[ownership.Claim]:
        """Observed.checkpoint_claims: the other live jobs of the namespace on an overlapping
        checkpoint directory, for a job that has not started (the only ones rule 2 holds)."""
        view = JobView(job)
        if view.status.get("phase"):
            return []
        pods = functools.partial(self.cache.job_pods, view.namespace)
        return ownership.claims(job, self.cache.jobs_in(view.namespace), pods)

    def _leases(self, job: JobView, pods: list[dict[str, Any]]) -> dict[str, str]:
        """spec.renewTime of the node Leases the reconciler may need (Observed.leases): those of
        the nodes in status.silentNodes and of the nodes whose kubelet it may find silent now
        (`silent_deletion`). Usually none; optional (a 403 or a node without a Lease tells less)."""
        now = datetime.now(UTC)
        nodes = {str(e.get("name")) for e in job.status.get("silentNodes") or []}
        deleting = [pod for pod in pods if (pod.get("metadata") or {}).get("deletionTimestamp")]
        for w in (self.workers.of(pod) for pod in deleting):  # a pass of 1,024 pods parses none of them
            if w.node_name and silent_deletion(w, now):
                nodes.add(w.node_name)
        nodes |= self._nodes_of_lost_ranks(job, pods)
        # At once, not one after the other: when KWOK (which plays every simulated kubelet) fell
        # behind deleting a 1,024-worker gang, one pass read the Leases of 128 nodes in 2.5 s.
        names = sorted(nodes)
        read = list(self._reads.map(functools.partial(self._lease, job), names)) if names else []
        return {node: renewed for node, renewed in zip(names, read, strict=True) if renewed}

    def _nodes_of_lost_ranks(self, job: JobView, pods: list[dict[str, Any]]) -> set[str]:
        """The nodes of the current generation's live workers while a peer of theirs exited
        EXIT_PEER_LOST: the pass may suspect one (dtjob.operator.suspects), and its Lease then
        tells a live kubelet from a stopped one. At most LEASE_READS of them (a gang whose
        survivors are still leaving); beyond, a suspected node is avoided for the full time."""
        generation = job.status.get("generation")
        current = [w for w in (self.workers.of(pod) for pod in pods) if w.generation == generation]
        if not any(w.exit_code == contract.EXIT_PEER_LOST for w in current):
            return set()
        live = sorted({w.node_name for w in current if w.node_name and not w.terminal})
        return set(live[:LEASE_READS])

    def _lease(self, job: JobView, node: str) -> str | None:
        """spec.renewTime of one node's Lease (None: none, or not readable)."""
        try:
            lease = self.raw.call(
                "GET",
                f"/apis/coordination.k8s.io/v1/namespaces/{NODE_LEASE_NAMESPACE}/leases/" + quoted(node),
                timeout=(5, 10),
            )
        except ApiException as e:
            if e.status not in (403, 404):
                raise
            log.debug("%s/%s: no Lease of node %s: %s", job.namespace, job.name, node, e.reason)
            return None
        renewed = (lease.get("spec") or {}).get("renewTime")
        return str(renewed) if renewed else None

    def _failed_worker_logs(self, job: JobView, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Log tails of the current generation's workers that exited EXIT_PEER_LOST (they name the
        rank that went silent), that failed when the pods restart in place (their agent's last line
        counts its restarts in place), and that failed without a termination message (the job's
        event quotes a failure's last line; FallbackToLogsOnError makes it the message on a
        kubelet). At most settings.log_reads_per_pass of them, those without a termination
        message naming the lost rank first."""
        in_place = not job.spec_errors and job.restart_in_place
        candidates = [
            w
            for w in (self.workers.of(pod) for pod in pods)
            if w.generation == job.status.get("generation")
            and w.phase == "Failed"
            and w.exit_code != contract.EXIT_STOPPED
            and (w.exit_code == contract.EXIT_PEER_LOST or in_place or not w.message)
        ]
        candidates.sort(key=lambda w: contract.parse_peer_lost_line(w.message or "") is not None)
        logs: dict[str, str] = {}
        for w in candidates[: self.settings.log_reads_per_pass]:
            try:
                text = self.core.read_namespaced_pod_log(
                    w.name,
                    job.namespace,
                    container="trainer",
                    tail_lines=self.settings.log_tail_lines,
                    _request_timeout=(5, 10),
                )
            except ApiException as e:
                log.debug("no log of %s/%s: %s", job.namespace, w.name, e.reason)
                continue
            logs[w.name] = str(text)
        return logs

    def _get_podgroup(self, job: JobView) -> dict[str, Any] | None:
        try:
            group = self.custom.get_namespaced_custom_object(
                PODGROUP_GROUP, PODGROUP_VERSION, job.namespace, PODGROUP_PLURAL, job.name
            )
            return cast(dict[str, Any], group)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _get_queue(self, job: JobView) -> tuple[dict[str, Any] | None, bool]:
        """The job's Volcano Queue (cluster-scoped) and whether it is missing. Optional: an install
        without the right to read queues (403) just says less about a waiting gang."""
        try:
            queue = self.custom.get_cluster_custom_object(
                PODGROUP_GROUP, PODGROUP_VERSION, QUEUE_PLURAL, job.queue or DEFAULT_QUEUE
            )
            return cast(dict[str, Any], queue), False
        except ApiException as e:
            if e.status == 404:
                return None, True
            if e.status == 403:
                log.debug("%s/%s: may not read Volcano queues: %s", job.namespace, job.name, e.reason)
                return None, False
            raise

    def _progress(self, job: JobView, pods: list[dict[str, Any]]) -> TrainerProgress | None:
        """Rank 0's progress: its last answer to the background scraper while it runs, its log's
        closing line once it succeeded."""
        generation = job.status.get("generation")
        for pod in pods:
            w = self.workers.of(pod)
            if w.rank != 0 or w.generation != generation:
                continue
            if w.phase == "Succeeded":
                self.scraper.forget((job.namespace, job.name))
                return self._final_step(job, w.name)
            ip = (pod.get("status") or {}).get("podIP")
            uid = str((pod.get("metadata") or {}).get("uid") or "")
            if w.phase == "Running" and ip:
                target = ScrapeTarget(uid, f"http://{ip}:{job.metrics_port}/metrics")
                deadline = job.progress_deadline_seconds
                return self.scraper.latest((job.namespace, job.name), target, deadline)
        self.scraper.forget((job.namespace, job.name))  # no rank 0 runs: nothing to scrape
        return None

    def _final_step(self, job: JobView, pod: str) -> TrainerProgress | None:
        """Where a finished rank 0 ended, from its log (its metrics endpoint is gone)."""
        if job.status.get("phase") in {JobPhase.SUCCEEDED, JobPhase.FAILED}:
            return None  # already recorded
        try:
            text = self.core.read_namespaced_pod_log(
                pod, job.namespace, tail_lines=self.settings.log_tail_lines, _request_timeout=(5, 10)
            )
        except ApiException as e:
            log.debug("no log of %s/%s: %s", job.namespace, pod, e.reason)
            return None
        return final_state_from_log(str(text))

    # acting -------------------------------------------------------------------------------
    def submit(
        self, job: Mapping[str, Any], actions: list[Action], on_head: Outcome, on_done: Outcome
    ) -> Future[None] | None:
        """Hand a pass's actions to the writer (dtjob.operator.writer) and return at once: the
        future resolves once the job's status and other own writes are answered (the job's next
        pass waits for it), `on_done` once its pod writes are."""
        return self.writer.submit(job, actions, on_head, on_done)

    def when_drained(self, job: Key, at_most: int, fn: Callable[[], object]) -> None:
        """`fn()` once the job has at most `at_most` pod writes in flight."""
        self.writer.when_drained(job, at_most, fn)

    def execute(self, job: Mapping[str, Any], actions: list[Action]) -> None:
        """Carry the actions out in order and wait for them (the runner's reports on the job; a
        pass uses `submit`); the first that fails raises ActionFailed (the rest are left for the
        next pass, which decides again from what it sees). A run of pod creations
        and deletions goes out settings.api_concurrency at a time; when some of them fail, the
        others still happen, and the first failed one (in the reconciler's order) is raised."""
        view = JobView(job)
        i = 0
        while i < len(actions):
            j = i
            while j < len(actions) and isinstance(actions[j], (CreatePod, DeletePod)):
                j += 1
            if j > i:
                self._pod_writes(view, cast(list[CreatePod | DeletePod], actions[i:j]))
                i = j
                continue
            try:
                self._execute_one(view, actions[i])
            except JobChanged:
                raise
            except Exception as error:
                raise ActionFailed(actions[i], error) from error
            i += 1

    def _pod_writes(self, job: JobView, writes: list[CreatePod | DeletePod]) -> None:
        ns = job.namespace
        log_pod_writes(job, writes)
        futures = [self.writer.pool.submit(self._pod_write, ns, w) for w in writes]
        for write, future in zip(writes, futures, strict=True):
            error = future.exception()
            if error is not None and not isinstance(error, Exception):
                raise error  # KeyboardInterrupt and the like: not the action's failure
            if error is not None:
                for rest in futures:
                    rest.exception()  # every write of the batch ends before the pass reports
                raise ActionFailed(write, error) from error

    def _pod_write(self, ns: str, action: CreatePod | DeletePod) -> None:
        pods = f"/api/v1/namespaces/{quoted(ns)}/pods"
        try:
            if isinstance(action, CreatePod):
                self.cache.assume_pod(self.raw.call("POST", pods, body=action.manifest, timeout=(10, 30)))
            else:
                query = {} if action.grace_seconds is None else {"gracePeriodSeconds": action.grace_seconds}
                deleted = self.raw.call("DELETE", f"{pods}/{quoted(action.name)}", query, timeout=(10, 30))
                if deleted.get("kind") == "Pod":
                    self.cache.assume_pod(deleted)
        except ApiException as e:
            # Already there (a create the cache had not seen yet) or already gone: done.
            if e.status != (409 if isinstance(action, CreatePod) else 404):
                raise

    def _execute_one(self, job: JobView, action: Action) -> None:
        ns, name = job.namespace, job.name
        match action:
            case PatchStatus(status=status):
                # Written over the job the pass read, or not at all: the pass decided from that
                # version (a cache may hold an older one than the API server, and a job deleted
                # and created again under the same name is another job).
                read = job.body
                for _ in range(BOOKKEEPING_RETRIES + 1):
                    rv = _get_rv(read)
                    patch = {"status": status, **({"metadata": {"resourceVersion": rv}} if rv else {})}
                    try:
                        written = self.custom.patch_namespaced_custom_object_status(
                            GROUP, VERSION, ns, PLURAL, name, patch
                        )
                        break
                    except ApiException as e:
                        if e.status != 409:
                            raise
                    now = self.get_job(ns, name, fresh=True)
                    # kopf's finalizer patch of a new job lands during its first pass's (500 jobs
                    # at once: 495 refused patches and passes decided again): a version that
                    # differs only there decides the same.
                    if now is None or not same_but_bookkeeping(read, now):
                        raise JobChanged(f"{ns}/{name} changed since the pass read it")
                    read = now
                else:
                    raise JobChanged(f"{ns}/{name} changed since the pass read it")
                if isinstance(written, dict):
                    self.cache.assume_job(written)
                    self.written[(ns, name)] = _get_rv(written)
                _log_waiting(ns, name, job.status, status)
            case CreateService(manifest=manifest):
                services = f"/api/v1/namespaces/{quoted(ns)}/services"
                try:
                    self.cache.assume_service(
                        self.raw.call("POST", services, body=manifest, timeout=(10, 30))
                    )
                except ApiException as e:
                    if e.status != 409:
                        raise
            case ApplyPodGroup(manifest=manifest, exists=exists):
                if exists:
                    self.custom.patch_namespaced_custom_object(
                        PODGROUP_GROUP,
                        PODGROUP_VERSION,
                        ns,
                        PODGROUP_PLURAL,
                        name,
                        gang.spec_patch(manifest),
                    )
                else:
                    _ignore(
                        409,
                        self.custom.create_namespaced_custom_object,
                        PODGROUP_GROUP,
                        PODGROUP_VERSION,
                        ns,
                        PODGROUP_PLURAL,
                        manifest,
                    )
            case DeleteJob(reason=reason):
                log.info("%s/%s: deleting the job: %s", ns, name, reason)
                _ignore(
                    404,
                    self.custom.delete_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    ns,
                    PLURAL,
                    name,
                    propagation_policy="Background",
                )
            case EmitEvent():
                self._event(job, action)
            case CountRestart(reason=reason):
                self.metrics.restarts.labels(reason=reason).inc()
            case CountRescale(direction=direction, reason=reason):
                self.metrics.rescales.labels(direction=direction, reason=reason).inc()
            case ObserveRecovery(seconds=seconds):
                self.metrics.recovery_seconds.observe(seconds)
            case JobRestarted() | JobRecovered():
                self.metrics.job_recovery(ns, name, action)

    def _event(self, job: JobView, event: EmitEvent) -> None:
        now = datetime.now(UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{job.name}.", namespace=job.namespace),
            involved_object=client.V1ObjectReference(
                api_version=API_VERSION, kind=KIND, name=job.name, namespace=job.namespace, uid=job.uid
            ),
            reason=event.reason,
            message=event.message[:1024],
            type=event.type,
            source=client.V1EventSource(component="dtjob-operator"),
            reporting_component="dtjob-operator",
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self.core.create_namespaced_event(job.namespace, body)
        except ApiException as e:  # an event is worth a log line, never a failed reconcile
            log.warning(
                "could not post event %s on %s/%s: %s", event.reason, job.namespace, job.name, e.reason
            )


# Metadata the reconciler never reads and others (kopf) write: a job changed only there since a
# pass read it decides the same, and its status patch is sent again over the new version.
BOOKKEEPING = frozenset({"resourceVersion", "managedFields", "finalizers", "annotations"})
BOOKKEEPING_RETRIES = 2


def same_but_bookkeeping(read: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether `now` differs from `read` only in BOOKKEEPING metadata."""

    def decided_from(job: Mapping[str, Any]) -> tuple[Any, ...]:
        meta = {k: v for k, v in (job.get("metadata") or {}).items() if k not in BOOKKEEPING}
        rest = {k: v for k, v in job.items() if k != "metadata"}
        return meta, rest

    return decided_from(read) == decided_from(now)


def _get_rv(job: Mapping[str, Any]) -> str:
    return str((job.get("metadata") or {}).get("resourceVersion") or "")


def _log_waiting(ns: str, name: str, before: Mapping[str, Any], patch: Mapping[str, Any]) -> None:
    """A log line when the job starts waiting for something else (condition Waiting's reason):
    what a stuck job waits for shows in the operator's log, not only on the job."""

    def waiting(conditions: Any) -> tuple[str, str] | None:
        for c in conditions or []:
            if c.get("type") == "Waiting":
                return (c.get("reason") or "", c.get("message") or "") if c.get("status") == "True" else None
        return None

    if "conditions" not in patch:
        return
    now, then = waiting(patch["conditions"]), waiting(before.get("conditions"))
    if now is not None and (then is None or then[0] != now[0]):
        log.info("%s/%s: %s", ns, name, now[1])


def request_kind(method: str, url: str) -> tuple[str, str]:
    """The Kubernetes verb and resource of one request ("list", "pods"; "patch",
    "distributedtrainingjobs/status"), from its method and URL."""
    split = urlsplit(url)
    query = split.query
    parts = [p for p in split.path.split("/") if p]
    # /api/v1/... or /apis/<group>/<version>/...; then namespaces/<ns>/ when namespaced.
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
        rest = rest[2:]
    resource = rest[0] if rest else ""
    named = len(rest) >= 2
    if len(rest) >= 3:
        resource = f"{resource}/{rest[2]}"
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method.upper())
    if verb is None:
        verb = "watch" if "watch=true" in query else "get" if named else "list"
    return verb, resource


def _count_requests(api: client.ApiClient, metrics: OperatorMetrics) -> None:
    """Counts every request of `api` in metrics.api_requests."""
    rest = api.rest_client
    send = rest.request

    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        verb, resource = request_kind(method, url)
        metrics.api_requests.labels(verb=verb, resource=resource).inc()
        return send(method, url, *args, **kwargs)

    rest.request = request  # type: ignore[method-assign]  # the client has no hook for it


def _controlled_by(pod: Mapping[str, Any], uid: str) -> bool:
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("uid") == uid:
            return True
    return False


def _ignore(status: int, call: Any, *args: Any, **kwargs: Any) -> None:
    try:
        call(*args, **kwargs)
    except ApiException as e:
        if e.status != status:
            raise
