"""How long a pod's change takes to show in its job's status, from watches on pods and jobs (never
the operator's log): bench/scale.py's status lag.

A pod's change shows in the status when a version of the job says it:
- a worker went Running: readyReplicas counts it (as many of its generation's workers Running as
  the watch had seen by then), or the job moved past its generation (a restart), or finished;
- a worker failed: the job moved past its generation (the restart), or finished or is Failed.
The lag is from the pod watch's report of the change to the job watch's report of the first
version that says it (0 when the job said it first: the operator's watch was ahead of ours).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dtjob.devcluster.scale_harness import PodRecord, PodWatch

DONE = {"Succeeded", "Failed"}


@dataclass(frozen=True)
class JobVersion:
    """One version of a job's status, when the job watch reported it."""

    at: float
    generation: int
    phase: str
    ready: int


def _reflects(v: JobVersion, generation: int, ready: int | None) -> bool:
    """Whether the version says that `ready` workers of `generation` run (None: that a worker of
    it failed)."""
    if v.generation > generation or v.phase in DONE:
        return True
    if ready is None:
        return v.generation == generation and v.phase == "Restarting"
    return v.generation == generation and v.ready >= ready


def status_lags(
    pods: Iterable[PodRecord], versions: Mapping[str, Sequence[JobVersion]]
) -> dict[str, list[float]]:
    """The lag of every pod change ("running", "failed") seen by the pod watch; a change no version
    says yet counts as unbounded (inf), so it cannot pass for a short one."""
    gangs: dict[tuple[str, int], list[PodRecord]] = {}
    for record in pods:
        gangs.setdefault((record.job, record.generation), []).append(record)
    lags: dict[str, list[float]] = {"running": [], "failed": []}
    for (job, generation), gang in gangs.items():
        seen = sorted(versions.get(job, ()), key=lambda v: v.at)
        for pod in gang:
            changes: list[tuple[str, float, int | None]] = []
            if pod.running is not None:
                # Its generation's workers Running by then, this one included (the job counts them).
                count = sum(
                    1
                    for r in gang
                    if r.running is not None
                    and r.running <= pod.running
                    and (r.failed is None or r.failed > pod.running)
                )
                changes.append(("running", pod.running, count))
            if pod.failed is not None:
                changes.append(("failed", pod.failed, None))
            for kind, at, ready in changes:
                first = next((v for v in seen if _reflects(v, generation, ready)), None)
                lags[kind].append(math.inf if first is None else max(0.0, first.at - at))
    return lags


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(lags: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """p50, p99 and max of every kind and of all together, in seconds (None: unbounded)."""

    def of(values: Sequence[float]) -> dict[str, Any]:
        def s(v: float | None) -> float | None:
            return None if v is None or math.isinf(v) else round(v, 3)

        return {
            "n": len(values),
            "p50_s": s(percentile(values, 0.5)),
            "p99_s": s(percentile(values, 0.99)),
            "max_s": s(max(values) if values else None),
        }

    out = {kind: of(values) for kind, values in lags.items()}
    out["all"] = of([v for values in lags.values() for v in values])
    return out


@dataclass
class JobWatch(PodWatch):
    """Every status version of one namespace's jobs, as the watch reports it."""

    versions: dict[str, list[JobVersion]] = field(default_factory=dict)

    def path(self) -> str:
        return f"/apis/training.dtjob.io/v1alpha1/namespaces/{self.namespace}/distributedtrainingjobs"

    def _record(self, kind: str, job: dict[str, Any]) -> None:
        status = job.get("status") or {}
        version = JobVersion(
            time.time(),
            int(status.get("generation") or 0),
            str(status.get("phase") or ""),
            int(status.get("readyReplicas") or 0),
        )
        with self._lock:
            self.versions.setdefault(job["metadata"]["name"], []).append(version)

    def snapshot(self) -> dict[str, list[JobVersion]]:
        if self.error is not None:
            raise RuntimeError(f"the watch of {self.namespace}'s jobs failed: {self.error}")
        with self._lock:
            return {name: list(v) for name, v in self.versions.items()}
