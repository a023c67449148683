"""The impure side of a reconcile: observe a job, ask the pure reconciler, execute its actions.

`JobPassRunner.trigger(namespace, name)` is what every kopf handler calls. Triggers of one job
coalesce (`Coalescer`): never two passes of a job at once, and every trigger answered by a pass
that starts after it.
"""

from __future__ import annotations

import json
import logging
import time

from kubernetes.client.rest import ApiException

from dtjob.operator.coalescer import Coalescer
from dtjob.operator.kube import Kube
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.reconciler import reconcile
from dtjob.operator.settings import OperatorSettings

log = logging.getLogger("dtjob.operator")


class JobPassRunner:
    """Runs observe -> reconcile -> execute passes, one job at a time per job."""

    def __init__(self, kube: Kube, metrics: OperatorMetrics, settings: OperatorSettings) -> None:
        self.kube = kube
        self.metrics = metrics
        self.settings = settings
        self._passes: Coalescer[tuple[str, str]] = Coalescer(lambda key: self._once(*key))

    def trigger(self, namespace: str, name: str) -> None:
        """Run a pass of this job now, or make the pass in flight go once more."""
        self._passes.trigger((namespace, name))

    def _once(self, namespace: str, name: str) -> None:
        started = time.perf_counter()
        job = self.kube.get_job(namespace, name)
        if job is None:
            self.metrics.job_phase(namespace, name, None)
            return
        actions = reconcile(self.kube.observe(job), self.settings.reconciler)
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


def _message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message", error.body))
    except ValueError:
        return str(error.body)
