"""Thin kopf handlers: every trigger ends in `JobPassRunner.trigger_soon(namespace, name)`, which
runs the job's pass on the runner's threads a moment later, together with every other trigger of
the job meanwhile (kopf's thread returns at once).

Triggers: a timer per job (`JobPassRunner.tick`: it runs a pass only when the job's last plan
wants one by now, or after `resync_seconds`), and any event of the job itself (spec change such
as `kubectl scale`, status) once kopf has put its finalizer on it (`finalized`). Pods and nodes
are not watched through kopf: the operator's own caches (dtjob.operator.cache) watch them and
trigger the job of a pod that changed (a worker failed, was deleted, started running) or of a
lost node once they hold the change, so the pass they trigger sees it, and recovery starts as
soon as the API server reports it. Each handler also tells the runner that kopf handed it the job
(`handed`): kopf's peering pauses every handler of a replica that is not the active one.
"""

from __future__ import annotations

from typing import Any

import kopf

from dtjob.api import JobPhase
from dtjob.operator.jobview import FINALIZER, GROUP, PLURAL, VERSION, finalized
from dtjob.operator.passes import JobPassRunner
from dtjob.operator.settings import OperatorSettings


def needs_timer(phase: str | None, spec: Any) -> bool:
    """Whether time alone can change what a job needs: not for a Suspended job, nor for a
    finished one without ttlSecondsAfterFinished (their pod and spec changes arrive as events)."""
    if phase == JobPhase.SUSPENDED:
        return False
    if phase in {JobPhase.SUCCEEDED, JobPhase.FAILED}:
        return (spec.get("runPolicy") or {}).get("ttlSecondsAfterFinished") is not None
    return True


def build_registry(runner: JobPassRunner, settings: OperatorSettings) -> kopf.OperatorRegistry:
    """The kopf handlers, registered on their own registry (so tests and main build it fresh)."""
    registry = kopf.OperatorRegistry()
    max_workers = settings.max_workers  # the startup handler's own `settings` are kopf's

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        # Events are ours (EmitEvent, one per transition); kopf's per-handler log events would
        # bury them.
        settings.posting.enabled = False
        settings.execution.max_workers = max_workers
        # No runtime watch of CRDs and namespaces: the job CRD exists before the operator starts
        # (helm installs it first), and a least-privilege install (the helm chart) grants neither,
        # which kopf would otherwise report with a burst of retried 403 errors at every start.
        settings.scanning.disabled = True

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own credentials, from the same kubeconfig / service account as our client
        # (a custom registry does not inherit kopf's default login handlers).
        return kopf.login_via_client(**kwargs)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=settings.interval_seconds, registry=registry)
    def job_timer(namespace: str | None, name: str, status: kopf.Status, spec: kopf.Spec, **_: Any) -> None:
        runner.handed(namespace or "default", name)
        if not needs_timer(status.get("phase"), spec):
            return  # idle: only a spec change (a job event) or a pod event can change anything
        runner.tick(namespace or "default", name)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def job_event(type: str, namespace: str | None, name: str, meta: kopf.Meta, **_: Any) -> None:
        if type == "DELETED":
            runner.forget(namespace or "default", name)
            return
        runner.handed(namespace or "default", name)
        if finalized(meta) and not runner.own_status(
            namespace or "default", name, meta.get("resourceVersion")
        ):
            runner.trigger_soon(namespace or "default", name)

    return registry
