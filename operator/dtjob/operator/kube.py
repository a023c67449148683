"""The operator's Kubernetes client: observe a job's world, execute the reconciler's actions.

Synchronous (the kubernetes client); kopf runs the sync handlers in its thread pool. Every call
here is idempotent under retries: creates tolerate AlreadyExists, deletes tolerate NotFound.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from dtjob import contract
from dtjob.operator import gang
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
    ObserveRecovery,
    PatchStatus,
)
from dtjob.operator.jobview import API_VERSION, GROUP, KIND, LABEL_JOB, PLURAL, VERSION, JobView
from dtjob.operator.manifests import PODGROUP_API_VERSION
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.reconciler import Observed, Worker
from dtjob.operator.settings import ObserverSettings

log = logging.getLogger("dtjob.operator")
PODGROUP_GROUP, PODGROUP_VERSION = PODGROUP_API_VERSION.split("/")
PODGROUP_PLURAL = "podgroups"
QUEUE_PLURAL = "queues"
# The queue of a PodGroup that names none (vc-scheduler's --default-queue).
DEFAULT_QUEUE = "default"
TRAINER_GAUGES = {
    contract.METRIC_STEP: "step",
    contract.METRIC_LAST_CHECKPOINT_STEP: "checkpoint_step",
    contract.METRIC_LAST_CHECKPOINT_TIME: "checkpoint_time",
}


def load_config() -> None:
    """In-cluster service account when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def _dict(api: client.ApiClient, obj: Any) -> dict[str, Any]:
    return cast(dict[str, Any], api.sanitize_for_serialization(obj))


def parse_trainer_metrics(text: str) -> TrainerProgress:
    """Pick the trainer's gauges out of Prometheus text exposition format."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        name = name.split("{", 1)[0]
        if name in TRAINER_GAUGES:
            try:
                values[TRAINER_GAUGES[name]] = float(rest.split()[0])
            except (ValueError, IndexError):
                continue
    step = values.get("step")
    checkpoint_step = values.get("checkpoint_step")
    return TrainerProgress(
        step=None if step is None else int(step),
        # the trainer reports -1 (or nothing) before its first checkpoint
        checkpoint_step=None if checkpoint_step is None or checkpoint_step < 0 else int(checkpoint_step),
        checkpoint_time=values.get("checkpoint_time") or None,
        checkpoints_published=checkpoint_step is not None,
    )


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
    """One client for the whole operator."""

    def __init__(self, metrics: OperatorMetrics, settings: ObserverSettings) -> None:
        self.settings = settings
        self.api = client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.metrics = metrics
        self._cluster_lock = threading.Lock()
        self._cluster_view: tuple[float, list[dict[str, Any]], list[dict[str, Any]]] | None = None

    # observing ----------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return cast(
                dict[str, Any],
                self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name),
            )
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def _cluster(self, namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Nodes, and the pods bound to nodes (cached briefly: settings.cluster_view_ttl_seconds)."""
        with self._cluster_lock:
            now = time.monotonic()
            if self._cluster_view and now - self._cluster_view[0] < self.settings.cluster_view_ttl_seconds:
                return self._cluster_view[1], self._cluster_view[2]
            nodes = [_dict(self.api, n) for n in self.core.list_node().items]
            try:
                bound = self.core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=").items
            except ApiException as e:
                if e.status != 403:
                    raise
                # a namespaced operator may not list every pod: count what it can see
                bound = self.core.list_namespaced_pod(namespace, field_selector="spec.nodeName!=").items
            pods = [_dict(self.api, p) for p in bound]
            self._cluster_view = (now, nodes, pods)
            return nodes, pods

    def observe(self, job: dict[str, Any]) -> Observed:
        view = JobView(job)
        pods = [
            _dict(self.api, p)
            for p in self.core.list_namespaced_pod(
                view.namespace, label_selector=f"{LABEL_JOB}={view.name}"
            ).items
        ]
        # Only pods this job controls (a same-named predecessor's pods are left to the GC).
        pods = [p for p in pods if _controlled_by(p, view.uid)]
        nodes, node_pods = self._cluster(view.namespace)
        try:
            self.core.read_namespaced_service(view.name, view.namespace)
            service_exists = True
        except ApiException as e:
            if e.status != 404:
                raise
            service_exists = False
        # An invalid spec is reported by the reconciler; observing must not trip over it first.
        spec_ok = not view.spec_errors
        podgroup = self._get_podgroup(view) if spec_ok and view.uses_podgroup else None
        queue, queue_missing = self._get_queue(view) if podgroup is not None else (None, False)
        return Observed(
            job=job,
            pods=pods,
            nodes=nodes,
            now=datetime.now(UTC),
            node_pods=node_pods,
            service_exists=service_exists,
            podgroup=podgroup,
            progress=self._scrape_rank0(view, pods) if spec_ok else None,
            worker_logs=self._peer_lost_logs(view, pods),
            queue=queue,
            queue_missing=queue_missing,
        )

    def _peer_lost_logs(self, job: JobView, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Log tails of the current generation's workers that exited EXIT_PEER_LOST: they name
        the rank that went silent."""
        logs: dict[str, str] = {}
        for pod in pods:
            w = Worker.of(pod)
            if w.generation != job.status.get("generation") or w.exit_code != contract.EXIT_PEER_LOST:
                continue
            try:
                text = self.core.read_namespaced_pod_log(
                    w.name, job.namespace, container="trainer", tail_lines=self.settings.log_tail_lines
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

    def _scrape_rank0(self, job: JobView, pods: list[dict[str, Any]]) -> TrainerProgress | None:
        generation = job.status.get("generation")
        for pod in pods:
            w = Worker.of(pod)
            if w.rank == 0 and w.generation == generation and w.phase == "Succeeded":
                return self._final_step(job, w.name)
            ip = (pod.get("status") or {}).get("podIP")
            if w.rank == 0 and w.generation == generation and w.phase == "Running" and ip:
                url = f"http://{ip}:{job.metrics_port}/metrics"
                try:
                    with urllib.request.urlopen(
                        url, timeout=self.settings.metrics_timeout_seconds
                    ) as response:
                        return parse_trainer_metrics(response.read().decode())
                except OSError as e:
                    log.debug("no metrics from %s: %s", url, e)
        return None

    def _final_step(self, job: JobView, pod: str) -> TrainerProgress | None:
        """Where a finished rank 0 ended, from its log (its metrics endpoint is gone)."""
        if job.status.get("phase") in {"Succeeded", "Failed"}:
            return None  # already recorded
        try:
            text = self.core.read_namespaced_pod_log(
                pod, job.namespace, tail_lines=self.settings.log_tail_lines
            )
        except ApiException as e:
            log.debug("no log of %s/%s: %s", job.namespace, pod, e.reason)
            return None
        return final_state_from_log(str(text))

    # acting -------------------------------------------------------------------------------
    def execute(self, job: Mapping[str, Any], actions: list[Action]) -> None:
        """Carry the actions out in order; the first that fails raises ActionFailed (the rest are
        left for the next pass, which decides again from what it sees)."""
        view = JobView(job)
        for action in actions:
            try:
                self._execute_one(view, action)
            except Exception as error:
                raise ActionFailed(action, error) from error

    def _execute_one(self, job: JobView, action: Action) -> None:
        ns, name = job.namespace, job.name
        match action:
            case PatchStatus(status=status):
                self.custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, ns, PLURAL, name, {"status": status}
                )
            case CreateService(manifest=manifest):
                _ignore(409, self.core.create_namespaced_service, ns, manifest)
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
                    _ignore(409, self.custom.create_namespaced_custom_object,
                            PODGROUP_GROUP, PODGROUP_VERSION, ns, PODGROUP_PLURAL, manifest)  # fmt: skip
            case CreatePod(manifest=manifest):
                log.info("%s/%s: creating %s", ns, name, action.name)
                _ignore(409, self.core.create_namespaced_pod, ns, manifest)
            case DeletePod(name=pod, reason=reason, grace_seconds=grace):
                log.info("%s/%s: deleting %s (grace %s): %s", ns, name, pod, grace, reason)
                _ignore(404, self.core.delete_namespaced_pod, pod, ns, grace_period_seconds=grace)
            case DeleteJob(reason=reason):
                log.info("%s/%s: deleting the job: %s", ns, name, reason)
                _ignore(404, self.custom.delete_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, name,
                        propagation_policy="Background")  # fmt: skip
            case EmitEvent():
                self._event(job, action)
            case CountRestart(reason=reason):
                self.metrics.restarts.labels(reason=reason).inc()
            case CountRescale(direction=direction, reason=reason):
                self.metrics.rescales.labels(direction=direction, reason=reason).inc()
            case ObserveRecovery(seconds=seconds):
                self.metrics.recovery_seconds.observe(seconds)

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


class ActionFailed(Exception):
    """An action the API server (or the kubernetes client) refused; `error` says why."""

    def __init__(self, action: Action, error: Exception) -> None:
        super().__init__(f"{describe_action(action)}: {error}")
        self.action = action
        self.error = error


def describe_action(action: Action) -> str:
    """What an action does, in the words of an error message ("creating pod gpt-worker-0")."""
    match action:
        case PatchStatus():
            return "writing the job's status"
        case CreateService(manifest=manifest):
            return f"creating Service {manifest['metadata']['name']}"
        case ApplyPodGroup(manifest=manifest):
            return f"applying PodGroup {manifest['metadata']['name']}"
        case CreatePod():
            return f"creating pod {action.name}"
        case DeletePod(name=pod):
            return f"deleting pod {pod}"
        case DeleteJob():
            return "deleting the job"
        case EmitEvent(reason=reason):
            return f"posting event {reason}"
        case _:
            return f"recording {type(action).__name__}"


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
