"""Thin kopf handlers: every trigger ends in `JobReconciler.reconcile(namespace, name)`.

Triggers: a timer per job (scrapes the trainer's step, notices deadlines, TTLs and node loss), any
event of the job itself (create, spec change such as `kubectl scale`, status), and any event of a
pod labelled with a job name (a worker failed, was deleted, started running), so recovery starts
as soon as the API server reports the change.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from dtjob.operator.coalescer import Coalescer
from dtjob.operator.jobview import GROUP, LABEL_JOB, PLURAL, VERSION
from dtjob.operator.kube import Kube
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.reconciler import reconcile

log = logging.getLogger("dtjob.operator")
FINALIZER = "training.dtjob.io/operator"


class JobReconciler:
    """Runs observe -> reconcile -> execute for one job at a time.

    Concurrent triggers for the same job coalesce (`Coalescer`): while a pass runs, further
    triggers only make the running pass go once more, so there is never more than one pass per
    job in flight and never a trigger lost.
    """

    def __init__(self, kube: Kube, metrics: OperatorMetrics) -> None:
        self.kube = kube
        self.metrics = metrics
        self._passes: Coalescer[tuple[str, str]] = Coalescer(lambda key: self._once(*key))

    def reconcile(self, namespace: str, name: str) -> None:
        self._passes.trigger((namespace, name))

    def _once(self, namespace: str, name: str) -> None:
        started = time.perf_counter()
        job = self.kube.get_job(namespace, name)
        if job is None:
            self.metrics.job_phase(namespace, name, None)
            return
        actions = reconcile(self.kube.observe(job))
        try:
            self.kube.execute(job, actions)
        except ApiException as e:
            # Level-triggered: the next trigger (at the latest the timer) observes again and
            # decides again, so a failed call needs a log line, not a retry of its own.
            log.warning("%s/%s: %s %s: %s", namespace, name, e.status, e.reason, _message(e))
        phase = (job.get("status") or {}).get("phase")
        for action in actions:
            if hasattr(action, "status") and "phase" in action.status:
                phase = action.status["phase"]
        self.metrics.job_phase(namespace, name, phase)
        self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    def forget(self, namespace: str, name: str) -> None:
        self.metrics.job_phase(namespace, name, None)


def needs_timer(phase: str | None, spec: Any) -> bool:
    """Whether time alone can change what a job needs: not for a Suspended job, nor for a
    finished one without ttlSecondsAfterFinished (their pod and spec changes arrive as events)."""
    if phase == "Suspended":
        return False
    if phase in {"Succeeded", "Failed"}:
        return (spec.get("runPolicy") or {}).get("ttlSecondsAfterFinished") is not None
    return True


def _message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message", error.body))
    except ValueError:
        return str(error.body)


def build_registry(reconciler: JobReconciler, interval: float) -> kopf.OperatorRegistry:
    """The kopf handlers, registered on their own registry (so tests and main build it fresh)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        # Events are ours (EmitEvent, one per transition); kopf's per-handler log events would
        # bury them.
        settings.posting.enabled = False
        # Sync handlers run in this many threads: one pass per job at a time, many jobs at once.
        settings.execution.max_workers = 16
        # No runtime watch of CRDs and namespaces: the job CRD exists before the operator starts
        # (helm installs it first), and a least-privilege install (the helm chart) grants neither,
        # which kopf would otherwise report with a burst of retried 403 errors at every start.
        settings.scanning.disabled = True

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own credentials, from the same kubeconfig / service account as our client
        # (a custom registry does not inherit kopf's default login handlers).
        return kopf.login_via_client(**kwargs)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=interval, registry=registry)
    def job_timer(namespace: str | None, name: str, status: kopf.Status, spec: kopf.Spec, **_: Any) -> None:
        if not needs_timer(status.get("phase"), spec):
            return  # idle: only a spec change (a job event) or a pod event can change anything
        reconciler.reconcile(namespace or "default", name)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def job_event(type: str, namespace: str | None, name: str, **_: Any) -> None:
        if type == "DELETED":
            reconciler.forget(namespace or "default", name)
        else:
            reconciler.reconcile(namespace or "default", name)

    @kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT}, registry=registry)
    def pod_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
        reconciler.reconcile(namespace or "default", labels[LABEL_JOB])

    return registry
