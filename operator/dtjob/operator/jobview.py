"""A read-only view of a DistributedTrainingJob object (a plain dict, as the API server returns it).

This module is the one place where the operator reads spec field names, so the reconciler and the
manifest builders stay independent of how the object arrived (kopf body, kubernetes client dict,
a test fixture). Defaults here match the CRD's defaults, so an object created by an API server
without defaulting (or a unit-test dict) behaves the same as one that went through the CRD.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GROUP = "training.dtjob.io"
VERSION = "v1alpha1"
PLURAL = "distributedtrainingjobs"
KIND = "DistributedTrainingJob"
API_VERSION = f"{GROUP}/{VERSION}"

# Labels of DESIGN.md ("What the operator gives each worker pod").
LABEL_JOB = "training.dtjob.io/job-name"
LABEL_RANK = "training.dtjob.io/rank"
LABEL_GENERATION = "training.dtjob.io/generation"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "dtjob-operator"

TRAINER_CONTAINER = "trainer"
DEFAULT_MASTER_PORT = 29500
# The trainer's Prometheus endpoint inside each pod's own network namespace; every pod has its
# own IP, so one fixed port for all workers is enough.
DEFAULT_METRICS_PORT = 9400
# How long a gang may stay unschedulable before the job shrinks to what fits.
DEFAULT_SCHEDULING_TIMEOUT_SECONDS = 60
DEFAULT_MAX_RESTARTS = 3
DEFAULT_CHECKPOINT_MOUNT_PATH = "/checkpoints"
# The exit code of a trainer that stopped cleanly after a checkpoint (DESIGN.md, Trainer contract).
EXIT_CHECKPOINTED = 75
# Exit codes meaning "this will fail again however often it is restarted", after Kubeflow's
# ExitCode restart policy: 1 and 2 are generic errors and usage errors, 126/127 a command that
# cannot run or does not exist. Signals (128+n) and 75 are retryable. The spec can override.
DEFAULT_PERMANENT_EXIT_CODES: tuple[int, ...] = (2, 126, 127)


def _get(obj: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur or cur[key] is None:
            return default
        cur = cur[key]
    return cur


@dataclass(frozen=True)
class JobView:
    """The fields of a job the operator acts on, with defaults applied."""

    body: Mapping[str, Any]

    # identity -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(_get(self.body, "metadata", "name", default=""))

    @property
    def namespace(self) -> str:
        return str(_get(self.body, "metadata", "namespace", default="default"))

    @property
    def uid(self) -> str:
        return str(_get(self.body, "metadata", "uid", default=""))

    @property
    def deleting(self) -> bool:
        return _get(self.body, "metadata", "deletionTimestamp") is not None

    @property
    def spec(self) -> Mapping[str, Any]:
        return _get(self.body, "spec", default={})

    @property
    def status(self) -> Mapping[str, Any]:
        return _get(self.body, "status", default={})

    # sizes --------------------------------------------------------------------------------
    @property
    def replicas(self) -> int:
        return int(_get(self.spec, "replicas", default=1))

    @property
    def min_replicas(self) -> int:
        return int(_get(self.spec, "elastic", "minReplicas", default=self.replicas))

    @property
    def max_replicas(self) -> int | None:
        """None: no upper bound."""
        value = _get(self.spec, "elastic", "maxReplicas", default=None)
        return None if value is None else int(value)

    @property
    def desired_replicas(self) -> int:
        """spec.replicas clamped into [minReplicas, maxReplicas] (the API server enforces it too)."""
        upper = self.max_replicas if self.max_replicas is not None else self.replicas
        return max(self.min_replicas, min(self.replicas, upper))

    @property
    def max_restarts(self) -> int:
        return int(_get(self.spec, "elastic", "maxRestarts", default=DEFAULT_MAX_RESTARTS))

    @property
    def scheduling_timeout_seconds(self) -> float:
        """elastic.unschedulableTimeoutSeconds: how long pods may stay unschedulable."""
        value = _get(self.spec, "elastic", "unschedulableTimeoutSeconds", default=None)
        return float(DEFAULT_SCHEDULING_TIMEOUT_SECONDS if value is None else value)

    @property
    def restart_policy(self) -> str:
        """OnFailure (always restart), Never (any failure fails the job) or ExitCode (default)."""
        return str(_get(self.spec, "elastic", "restartPolicy", default="ExitCode"))

    def is_permanent_exit_code(self, code: int) -> bool:
        """Whether a worker's failure fails the job at once instead of restarting the gang."""
        if self.restart_policy == "Never":
            return True
        if self.restart_policy == "OnFailure":
            return False
        codes = _get(self.spec, "elastic", "permanentExitCodes", default=DEFAULT_PERMANENT_EXIT_CODES)
        return code in {int(c) for c in codes}

    # ports and paths ----------------------------------------------------------------------
    @property
    def master_port(self) -> int:
        return int(_get(self.spec, "masterPort", default=DEFAULT_MASTER_PORT))

    @property
    def metrics_port(self) -> int:
        return int(_get(self.spec, "metricsPort", default=DEFAULT_METRICS_PORT))

    @property
    def checkpoint_mount_path(self) -> str:
        return str(_get(self.spec, "checkpoint", "mountPath", default=DEFAULT_CHECKPOINT_MOUNT_PATH))

    @property
    def checkpoint_volume(self) -> Mapping[str, Any] | None:
        return _get(self.spec, "checkpoint", "volume", default=None)

    @property
    def template(self) -> Mapping[str, Any]:
        return _get(self.spec, "template", default={})

    # scheduling ---------------------------------------------------------------------------
    @property
    def scheduler_name(self) -> str | None:
        name = _get(self.spec, "scheduling", "schedulerName", default=None)
        if name is None and self.gang:
            return "volcano"
        return None if name is None else str(name)

    @property
    def gang(self) -> bool:
        return bool(_get(self.spec, "scheduling", "gang", default=False))

    @property
    def uses_podgroup(self) -> bool:
        """A Volcano PodGroup is made when the job asks for Volcano or for gang scheduling."""
        return self.gang or _get(self.spec, "scheduling", "schedulerName", default=None) == "volcano"

    @property
    def queue(self) -> str | None:
        return _get(self.spec, "scheduling", "queue", default=None)

    @property
    def priority_class_name(self) -> str | None:
        return _get(self.spec, "scheduling", "priorityClassName", default=None)

    # run policy ---------------------------------------------------------------------------
    @property
    def suspend(self) -> bool:
        return bool(_get(self.spec, "runPolicy", "suspend", default=False))

    @property
    def active_deadline_seconds(self) -> int | None:
        value = _get(self.spec, "runPolicy", "activeDeadlineSeconds", default=None)
        return None if value is None else int(value)

    @property
    def ttl_seconds_after_finished(self) -> int | None:
        value = _get(self.spec, "runPolicy", "ttlSecondsAfterFinished", default=None)
        return None if value is None else int(value)

    @property
    def clean_pod_policy(self) -> str:
        """Which pods to delete once the job finished: All, Running (default) or None."""
        return str(_get(self.spec, "runPolicy", "cleanPodPolicy", default="Running"))

    @property
    def selector(self) -> str:
        """The label selector string of the scale subresource (status.selector)."""
        return f"{LABEL_JOB}={self.name}"
