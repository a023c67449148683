"""Pod writes in flight, and how a pass sees them (controller-runtime's "expectations").

A pass hands its pod creations and deletions to the writer (dtjob.operator.writer) and returns
without waiting for their answers; the job's next pass may run while they are in flight. That
pass must not create or delete the same pods again, nor take a pod whose deletion it asked for as
one still to delete: it sees the pods as the writes in flight will leave them (`overlay`), as
controller-runtime's ReplicaSet controller counts the creations it expects before it trusts its
cache again. Each expectation lasts until its write is answered (the answer is in the cache then)
or fails (the next pass decides again from the cache alone, and the failure shows on the job).

`overlay` is pure: the cached pods and the writes in flight in, the pods a pass decides from out.
A creation not answered yet is a Pending pod without a node, created "now": an unschedulable
timeout counts from no earlier than the moment the pass sees it. A deletion not answered yet
marks its pod deleting with a deadline of "now" plus its grace period: the API server sets the
deadline when the deletion reaches it, so a deletion still in the writer's queue is never one
that a kubelet left unfinished (a silent kubelet, see nodes.silent_deletion).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from dtjob.operator.actions import CreatePod, DeletePod
from dtjob.operator.cache import trim_pod
from dtjob.operator.timefmt import to_rfc3339

Key = tuple[str, str]  # the job: (namespace, name)
Obj = dict[str, Any]
PodWrite = CreatePod | DeletePod
# The grace period of a pod whose spec names none (the API server's default).
DEFAULT_GRACE_SECONDS = 30


@dataclass(frozen=True)
class Expected:
    """One pod write in flight (`seq`: the order the writer was given them in, across jobs)."""

    write: PodWrite
    seq: int


class Expectations:
    """The pod writes in flight, by job and pod name, in the order they were given (a pod's later
    write is sent once its earlier one is answered, see dtjob.operator.writer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[Key, dict[str, list[Expected]]] = {}
        self._seq = 0

    def expect(self, job: Key, writes: Sequence[PodWrite]) -> list[Expected]:
        """Record writes about to be sent; returns them as recorded (to pass to `done`)."""
        with self._lock:
            pods = self._jobs.setdefault(job, {})
            recorded = []
            for write in writes:
                self._seq += 1
                expected = Expected(write, self._seq)
                pods.setdefault(write.name, []).append(expected)
                recorded.append(expected)
            return recorded

    def done(self, job: Key, expected: Expected) -> int:
        """The write was answered (its answer is in the cache) or failed; returns how many of the
        job's writes are still in flight."""
        with self._lock:
            pods = self._jobs.get(job)
            if pods is None:
                return 0
            name = expected.write.name
            queue = pods.get(name)
            if queue is not None and expected in queue:
                queue.remove(expected)
                if not queue:
                    del pods[name]
            if not pods:
                del self._jobs[job]
                return 0
            return sum(len(q) for q in pods.values())

    def in_flight(self, job: Key) -> int:
        with self._lock:
            return sum(len(q) for q in self._jobs.get(job, {}).values())

    def creating(self, job: Key, pod: str) -> bool:
        """Whether a creation of this pod of the job is in flight."""
        with self._lock:
            return any(isinstance(e.write, CreatePod) for e in self._jobs.get(job, {}).get(pod, ()))

    def pending(self, job: Key) -> dict[str, list[PodWrite]]:
        """The job's writes in flight by pod name, oldest first (a copy)."""
        with self._lock:
            return {name: [e.write for e in queue] for name, queue in self._jobs.get(job, {}).items()}


def overlay(pods: Sequence[Obj], pending: Mapping[str, Sequence[PodWrite]], now: datetime) -> list[Obj]:
    """The job's cached pods as its writes in flight will leave them: a creation not answered
    yet is a Pending pod made from its manifest (unless the cache holds the pod already), a
    deletion not answered yet marks its pod deleting (unless it is already). Sorted by name, as
    the cache gives them."""
    if not pending:
        return list(pods)
    by_name = {str((p.get("metadata") or {}).get("name")): p for p in pods}
    for name, writes in pending.items():
        pod = by_name.get(name)
        for write in writes:
            if isinstance(write, CreatePod):
                if pod is None:
                    pod = _created(write, now)
            elif pod is not None and not (pod.get("metadata") or {}).get("deletionTimestamp"):
                pod = _deleting(pod, write, now)
        if pod is not None:
            by_name[name] = pod
    return [by_name[name] for name in sorted(by_name)]


def _created(write: CreatePod, now: datetime) -> Obj:
    pod = trim_pod(write.manifest)
    meta = dict(pod.get("metadata") or {})
    meta["creationTimestamp"] = to_rfc3339(now)
    return {**pod, "metadata": meta, "status": {"phase": "Pending"}}


def _deleting(pod: Obj, write: DeletePod, now: datetime) -> Obj:
    grace = write.grace_seconds
    if grace is None:
        grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
    meta = dict(pod.get("metadata") or {})
    meta["deletionTimestamp"] = to_rfc3339(now + timedelta(seconds=int(grace)))
    meta["deletionGracePeriodSeconds"] = int(grace)
    return {**pod, "metadata": meta}
