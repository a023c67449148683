"""A read-only view of a DistributedTrainingJob object (a plain dict, as the API server returns it).

Identity and status are read from the raw object; every spec value comes from the API's model
(`DistributedTrainingJobSpec`, the single source of truth for field names and defaults), parsed
once per view. A spec the model rejects does not raise on construction: `spec_errors` names the
bad fields, so the reconciler can report them (condition Valid=False) before touching `spec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import ValidationError

from dtjob import contract
from dtjob.api.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    TRAINER_CONTAINER,
    VERSION,
    CheckpointSpec,
    CleanPodPolicy,
    DistributedTrainingJobSpec,
    RestartPolicy,
)
from dtjob.api.rules import InvalidJobError
from dtjob.operator import in_place
from dtjob.operator.quantity import parse_quantity

__all__ = [
    "API_VERSION",
    "EXIT_CHECKPOINTED",
    "GROUP",
    "KIND",
    "LABEL_GENERATION",
    "LABEL_JOB",
    "LABEL_MANAGED_BY",
    "LABEL_RANK",
    "MANAGED_BY",
    "PLURAL",
    "TRAINER_CONTAINER",
    "VERSION",
    "JobView",
]

# Labels of every worker pod (docs/design.md, "Labels, annotations, finalizer").
LABEL_JOB = "training.dtjob.io/job-name"
LABEL_RANK = "training.dtjob.io/rank"
LABEL_GENERATION = "training.dtjob.io/generation"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "dtjob-operator"
# kopf's finalizer on every job (its per-job timer needs one; dtjob.operator.handlers).
FINALIZER = "training.dtjob.io/operator"


def finalized(meta: Mapping[str, Any], finalizer: str = FINALIZER) -> bool:
    """Whether a job is ready for its first pass: kopf calls the event handlers of a new job
    before it puts its finalizer on it, and a status patch read before that patch is refused by
    it (500 jobs at once: about 490 refused status patches, each answered by a read of the job and
    the patch again). The finalizer's own event comes next. A job being deleted is ready at once."""
    return finalizer in (meta.get("finalizers") or []) or meta.get("deletionTimestamp") is not None


# The extended resource of a GPU: a trainer container asking for n of them runs n processes.
GPU_RESOURCE = "nvidia.com/gpu"

# The exit code of a trainer that stopped cleanly after a checkpoint (dtjob.contract).
EXIT_CHECKPOINTED = contract.EXIT_STOPPED


def _get(obj: Mapping[str, Any] | None, *path: str, default: Any = None) -> Any:
    cur: Any = obj
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur or cur[key] is None:
            return default
        cur = cur[key]
    return cur


def _parse_spec(body: Mapping[str, Any]) -> tuple[DistributedTrainingJobSpec | None, list[str]]:
    """The spec as the model (defaults filled in), or None and one `spec.<field>: message` per error."""
    try:
        return DistributedTrainingJobSpec.model_validate(_get(body, "spec", default={})), []
    except ValidationError as error:
        errors = [
            ".".join(("spec", *(str(part) for part in e["loc"]))) + f": {e['msg']}" for e in error.errors()
        ]
        return None, errors


@dataclass(frozen=True)
class JobView:
    """The fields of a job the operator acts on, with the API model's defaults applied.

    Not slotted: `cached_property` stores the parsed spec in the instance's __dict__.
    """

    body: Mapping[str, Any]

    # identity (raw object: always readable, even with an invalid spec) -------------------
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
    def status(self) -> Mapping[str, Any]:
        return _get(self.body, "status", default={})

    @property
    def selector(self) -> str:
        """The label selector string of the scale subresource (status.selector)."""
        return f"{LABEL_JOB}={self.name}"

    # the parsed spec ----------------------------------------------------------------------
    @cached_property
    def _parsed(self) -> tuple[DistributedTrainingJobSpec | None, list[str]]:
        return _parse_spec(self.body)

    @property
    def spec_errors(self) -> list[str]:
        """Why the spec is not a valid DistributedTrainingJobSpec; empty when it is."""
        return self._parsed[1]

    @property
    def spec(self) -> DistributedTrainingJobSpec:
        """The spec with defaults; InvalidJobError (naming the fields) if spec_errors is not empty."""
        spec, errors = self._parsed
        if spec is None:
            raise InvalidJobError(errors)
        return spec

    # sizes --------------------------------------------------------------------------------
    @property
    def replicas(self) -> int:
        return self.spec.replicas

    @property
    def min_replicas(self) -> int:
        return self.spec.min_world_size

    @property
    def max_replicas(self) -> int | None:
        """None: no upper bound."""
        return self.spec.elastic.max_replicas

    @property
    def desired_replicas(self) -> int:
        """spec.replicas clamped into [minReplicas, maxReplicas] (the API server enforces it too)."""
        upper = self.max_replicas if self.max_replicas is not None else self.replicas
        return max(self.min_replicas, min(self.replicas, upper))

    @property
    def max_restarts(self) -> int:
        return self.spec.elastic.max_restarts

    @property
    def scheduling_timeout_seconds(self) -> float:
        """elastic.unschedulableTimeoutSeconds: how long pods may stay unschedulable."""
        return float(self.spec.elastic.unschedulable_timeout_seconds)

    @property
    def heartbeat_timeout_seconds(self) -> int:
        """elastic.heartbeatTimeoutSeconds: a rank silent this long is lost (DTJOB_HEARTBEAT_TIMEOUT)."""
        return self.spec.elastic.heartbeat_timeout_seconds

    @property
    def progress_deadline_seconds(self) -> int | None:
        """elastic.progressDeadlineSeconds: None is off."""
        return self.spec.elastic.progress_deadline_seconds

    @property
    def restart_policy(self) -> str:
        """OnFailure (always restart), Never (any failure fails the job) or ExitCode (default)."""
        return self.spec.elastic.restart_policy.value

    @property
    def restart_in_place(self) -> bool:
        """Whether the pods run under dtjob's agent, which restarts the gang in place."""
        return self.restart_in_place_rule.on

    @property
    def restart_in_place_rule(self) -> in_place.InPlaceRule:
        """Restarts in place on or off, and why (dtjob.operator.in_place)."""
        container = self.spec.trainer_container() or {}
        return in_place.decide(
            self.spec.elastic.restart_policy == RestartPolicy.NEVER,
            self.spec.elastic.restart_in_place,
            [str(word) for word in container.get("command") or []],
            [str(word) for word in container.get("args") or []],
        )

    @property
    def permanent_exit_codes(self) -> list[int]:
        """The exit codes that fail the job at once (none under OnFailure)."""
        if self.spec.elastic.restart_policy == RestartPolicy.ON_FAILURE:
            return []
        return list(self.spec.elastic.permanent_exit_codes)

    def is_permanent_exit_code(self, code: int) -> bool:
        """Whether a worker's failure fails the job at once instead of restarting the gang."""
        policy = self.spec.elastic.restart_policy
        if policy == RestartPolicy.NEVER:
            return True
        if policy == RestartPolicy.ON_FAILURE:
            return False
        return code in self.spec.elastic.permanent_exit_codes

    # ports and paths ----------------------------------------------------------------------
    @property
    def nproc_per_worker(self) -> int:
        """Processes per worker pod: spec.nprocPerWorker, else the trainer's GPU limit, else 1."""
        if self.spec.nproc_per_worker is not None:
            return self.spec.nproc_per_worker
        container = self.spec.trainer_container() or {}
        limits = (container.get("resources") or {}).get("limits") or {}
        gpus = limits.get(GPU_RESOURCE)
        if gpus is None:
            return 1
        count = int(parse_quantity(str(gpus)))
        return count if count >= 1 else 1

    @property
    def master_port(self) -> int:
        return self.spec.master_port

    @property
    def metrics_port(self) -> int:
        return self.spec.metrics_port

    @property
    def checkpoint_mount_path(self) -> str:
        """DTJOB_CHECKPOINT_DIR; without spec.checkpoint, the model's default mountPath (the
        trainer then writes into its own container filesystem)."""
        checkpoint = self.spec.checkpoint
        if checkpoint is None:
            return str(CheckpointSpec.model_fields["mount_path"].default)
        return checkpoint.mount_path

    @property
    def checkpoint_volume(self) -> Mapping[str, Any] | None:
        checkpoint = self.spec.checkpoint
        return None if checkpoint is None else checkpoint.volume

    @property
    def template(self) -> Mapping[str, Any]:
        return self.spec.template

    # scheduling ---------------------------------------------------------------------------
    @property
    def scheduler_name(self) -> str | None:
        name = self.spec.scheduling.scheduler_name
        if name is None and self.gang:
            return "volcano"
        return name

    @property
    def gang(self) -> bool:
        return self.spec.scheduling.gang

    @property
    def uses_podgroup(self) -> bool:
        """A Volcano PodGroup is made when the job asks for Volcano or for gang scheduling."""
        return self.gang or self.spec.scheduling.scheduler_name == "volcano"

    @property
    def queue(self) -> str | None:
        return self.spec.scheduling.queue

    @property
    def priority_class_name(self) -> str | None:
        return self.spec.scheduling.priority_class_name

    # run policy ---------------------------------------------------------------------------
    @property
    def suspend(self) -> bool:
        return self.spec.run_policy.suspend

    @property
    def active_deadline_seconds(self) -> int | None:
        return self.spec.run_policy.active_deadline_seconds

    @property
    def ttl_seconds_after_finished(self) -> int | None:
        return self.spec.run_policy.ttl_seconds_after_finished

    @property
    def clean_pod_policy(self) -> str:
        """Which pods to delete once the job finished: All, Running (default) or None."""
        return CleanPodPolicy(self.spec.run_policy.clean_pod_policy).value
