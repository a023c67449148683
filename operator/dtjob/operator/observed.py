"""What the reconciler observes of one job: the job, its worker pods, the nodes and the rest
(`Observed`), and each worker pod reduced to what the rules need (`Worker`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dtjob.operator import gang, ownership
from dtjob.operator.conditions import condition_time
from dtjob.operator.jobview import LABEL_GENERATION, LABEL_RANK
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.timefmt import from_rfc3339

# Workers a WorkerCache holds before it starts over.
PARSED_LIMIT = 65536


@dataclass(frozen=True)
class Worker:
    """One observed worker pod, reduced to what the rules need."""

    name: str
    rank: int | None
    generation: int | None
    phase: str
    node_name: str | None
    deleting: bool
    exit_code: int | None
    created: datetime | None
    reason: str | None
    message: str | None = None  # the trainer container's termination message
    preempted: str | None = None  # the scheduler's message when it preempted the pod
    scheduled: datetime | None = None  # when a scheduler bound it to its node
    # The end of its deletion's grace period (the API server's deletionTimestamp): past it the
    # kubelet kills the containers and removes the pod at once.
    deletion_deadline: datetime | None = None
    deletion_grace: int | None = None  # that grace period, seconds (deletionGracePeriodSeconds)
    finished: datetime | None = None  # when the trainer container terminated (finishedAt)

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> Worker:
        """The pod, parsed (WorkerCache.of parses each version of a pod once)."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        status = pod.get("status") or {}
        exit_code, message, finished = None, None, None
        for container in status.get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated")
            if terminated is not None and (exit_code is None or container.get("name") == "trainer"):
                exit_code = int(terminated.get("exitCode", 0))
                message = terminated.get("message")
                finished = from_rfc3339(terminated.get("finishedAt"))
        return cls(
            name=str(meta.get("name", "")),
            rank=_int_or_none(labels.get(LABEL_RANK)),
            generation=_int_or_none(labels.get(LABEL_GENERATION)),
            phase=str(status.get("phase") or "Pending"),
            node_name=(pod.get("spec") or {}).get("nodeName"),
            deleting=meta.get("deletionTimestamp") is not None,
            exit_code=exit_code,
            created=from_rfc3339(meta.get("creationTimestamp")),
            reason=status.get("reason"),
            message=message,
            preempted=gang.preempted(pod),
            scheduled=condition_time(status, "PodScheduled"),
            deletion_deadline=from_rfc3339(meta.get("deletionTimestamp")),
            deletion_grace=meta.get("deletionGracePeriodSeconds"),
            finished=finished,
        )

    @property
    def terminal(self) -> bool:
        return self.phase in {"Succeeded", "Failed"}


class WorkerCache:
    """Workers parsed from pods, by (uid, resourceVersion, deletionTimestamp,
    deletionGracePeriodSeconds): a resourceVersion names one content of a pod, and the expectation
    of a deletion in flight (dtjob.operator.expectations) changes only the last two. Parsing every
    pod is 12-25 ms of a 1,024-worker job's 26-50 ms pass, several passes a second while the gang's
    pods change. Pods without a version (creations in flight, tests) are parsed each time.

    The operator keeps one for its life (`Kube.workers`) and gives it to every Observed; an
    Observed built without one gets its own, and parses each pod once per pass."""

    def __init__(self, limit: int = PARSED_LIMIT) -> None:
        self.limit = limit
        self._parsed: dict[tuple[Any, ...], Worker] = {}

    def of(self, pod: Mapping[str, Any]) -> Worker:
        """The pod as a worker: parsed once per version of the pod."""
        meta = pod.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if not rv or not meta.get("uid"):
            return Worker.of(pod)
        key = (meta.get("uid"), rv, meta.get("deletionTimestamp"), meta.get("deletionGracePeriodSeconds"))
        worker = self._parsed.get(key)
        if worker is None:
            if len(self._parsed) >= self.limit:
                self._parsed.clear()
            worker = self._parsed[key] = Worker.of(pod)
        return worker


@dataclass(frozen=True)
class Observed:
    """Everything the reconciler may look at. `pods` are the pods labelled with the job's name;
    `node_pods` are all pods bound to nodes (to count free capacity)."""

    job: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]]
    nodes: Sequence[Mapping[str, Any]]
    now: datetime
    node_pods: Sequence[Mapping[str, Any]] = ()
    service_exists: bool = True
    podgroup: Mapping[str, Any] | None = None
    progress: TrainerProgress | None = None
    # Log tails of the current generation's workers that exited EXIT_PEER_LOST, by pod name
    # (they name the lost rank).
    worker_logs: Mapping[str, str] = field(default_factory=dict)
    queue: Mapping[str, Any] | None = None  # the PodGroup's Volcano Queue (None: not readable)
    queue_missing: bool = False
    # spec.renewTime of the node Leases (kube-node-lease) of the nodes in status.silentNodes, of
    # the nodes of workers whose deletion may be found silent (`silent_deletion`), and of the
    # current generation's live workers while a peer exited EXIT_PEER_LOST (suspects.py), by
    # node name (absent: not read).
    leases: Mapping[str, str] = field(default_factory=dict)
    # The job's pod creations and deletions sent by earlier passes and not answered yet (`pods`
    # shows them as done, see dtjob.operator.expectations): they count against this pass's.
    pod_writes_in_flight: int = 0
    # The other live jobs of the namespace whose checkpoint directory overlaps the job's
    # (dtjob.operator.ownership); read only for a job that has not started (rule 2).
    checkpoint_claims: Sequence[ownership.Claim] = ()
    # Parses `pods` for the pass (one the operator keeps across passes, see WorkerCache).
    worker_cache: WorkerCache = field(default_factory=WorkerCache, compare=False, repr=False)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
