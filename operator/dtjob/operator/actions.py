"""What the reconciler asks the pass runner to do: small immutable records, executed in order.

The reconciler never talks to the API server; it returns a list of these, and the writer
(dtjob.operator.writer) carries them out for the pass runner (dtjob.operator.passes). A
PatchStatus always comes first, and no pod is created or deleted before it is answered, so a
decision (a new generation, a new world size) is recorded before any pod is: an operator killed
half-way through the list picks the same decision up again from the status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PatchStatus:
    """Merge-patch the job's status subresource with these fields."""

    status: dict[str, Any]


@dataclass(frozen=True)
class CreateService:
    manifest: dict[str, Any]


@dataclass(frozen=True)
class ApplyPodGroup:
    """Create the Volcano PodGroup, or patch the spec fields the operator owns (gang.OWNED_FIELDS)
    when they differ from the manifest (a new world size, a changed queue)."""

    manifest: dict[str, Any]
    exists: bool


@dataclass(frozen=True)
class CreatePod:
    manifest: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class DeletePod:
    """Delete a worker pod. grace_seconds None: the pod's own grace period (SIGTERM first, so
    the trainer checkpoints); 0: force (the pod's node is gone and cannot confirm anything)."""

    name: str
    reason: str
    grace_seconds: int | None = None


@dataclass(frozen=True)
class DeleteJob:
    """Delete the job itself (ttlSecondsAfterFinished); its children go with it."""

    reason: str


@dataclass(frozen=True)
class EmitEvent:
    """A Kubernetes Event on the job. type is Normal or Warning."""

    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class CountRestart:
    """Operator metric: one unplanned gang restart, by reason."""

    reason: str


@dataclass(frozen=True)
class CountRescale:
    """Operator metric: one change of world size; direction is up or down."""

    direction: str
    reason: str


@dataclass(frozen=True)
class ObserveRecovery:
    """Operator metric: seconds from seeing a failure to the next generation running."""

    seconds: float


@dataclass(frozen=True)
class JobRestarted:
    """Operator metric of the job: its gang stopped (a recovery began) for `cause`, and the steps
    past the newest checkpoint that the next gang redoes."""

    cause: str
    steps_redone: int


@dataclass(frozen=True)
class JobRecovered:
    """Operator metric of the job: a recovery's downtime, seconds."""

    cause: str
    seconds: float


Action = (
    PatchStatus
    | CreateService
    | ApplyPodGroup
    | CreatePod
    | DeletePod
    | DeleteJob
    | EmitEvent
    | CountRestart
    | CountRescale
    | ObserveRecovery
    | JobRestarted
    | JobRecovered
)
