"""Plain-dict jobs, pods and nodes shaped like the API server's objects, for the reconciler tests."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from dtjob.operator.actions import Action, CreatePod, DeletePod, EmitEvent, PatchStatus
from dtjob.operator.expectations import Expectations, overlay
from dtjob.operator.observed import Observed
from dtjob.operator.reconciler import reconcile
from dtjob.operator.settings import ReconcilerSettings
from dtjob.operator.timefmt import to_rfc3339

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def make_job(
    replicas: int = 4,
    min_replicas: int = 2,
    max_replicas: int = 4,
    max_restarts: int = 3,
    status: dict[str, Any] | None = None,
    cpu: str | int = "1",
    elastic: dict[str, Any] | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": replicas,
        "elastic": {
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "maxRestarts": max_restarts,
            "unschedulableTimeoutSeconds": 30,
            **(elastic or {}),
        },
        "checkpoint": {"mountPath": "/ckpt", "volume": {"hostPath": {"path": "/tmp/ckpt"}}},
        "masterPort": 29500,
        "template": {
            "metadata": {"labels": {"team": "ml"}},
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "image": "dtjob-trainer",
                        "command": ["python", "-m", "dtjob.trainer"],
                        "env": [{"name": "DTJOB_STEPS", "value": "50"}, {"name": "RANK", "value": "9"}],
                        "resources": {"requests": {"cpu": cpu}},
                    }
                ]
            },
        },
    }
    spec.update(spec_extra)
    job: dict[str, Any] = {
        "apiVersion": "training.dtjob.io/v1alpha1",
        "kind": "DistributedTrainingJob",
        "metadata": {"name": "gpt", "namespace": "ml", "uid": "uid-1"},
        "spec": spec,
    }
    if status is not None:
        job["status"] = status
    return job


def make_node(name: str, cpu: str = "2", ready: bool = True, **extra_status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {},
        "status": {
            "allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **extra_status,
        },
    }


def make_pod(
    rank: int,
    generation: int = 0,
    phase: str = "Running",
    node: str | None = "n1",
    exit_code: int | None = None,
    deleting: bool = False,
    created: float = 0.0,
    job: str = "gpt",
    grace_ends: float | None = None,
    grace: int = 5,
) -> dict[str, Any]:
    """A worker pod; `deleting`: its deletion's grace period (`grace` seconds) ends at `grace_ends`
    (default 300 s after its creation: the tests' passes, at 100 s, see it terminating within
    its grace)."""
    status: dict[str, Any] = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": exit_code}}}]
    meta: dict[str, Any] = {
        "name": f"{job}-worker-{rank}",
        "creationTimestamp": to_rfc3339(at(created)),
        "labels": {
            "training.dtjob.io/job-name": job,
            "training.dtjob.io/rank": str(rank),
            "training.dtjob.io/generation": str(generation),
        },
    }
    if deleting:
        meta["deletionTimestamp"] = to_rfc3339(at(created + 300 if grace_ends is None else grace_ends))
        meta["deletionGracePeriodSeconds"] = grace
    spec: dict[str, Any] = {"containers": [{"name": "trainer", "resources": {"requests": {"cpu": "1"}}}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": status}


def gang(
    size: int, generation: int = 0, nodes: tuple[str, ...] = ("n1", "n2"), **kw: Any
) -> list[dict[str, Any]]:
    """`size` running pods spread over `nodes` (two per node for 1-cpu pods on 2-cpu nodes)."""
    return [make_pod(r, generation, node=nodes[(r // 2) % len(nodes)], **kw) for r in range(size)]


def running_status(
    size: int = 4, generation: int = 0, restarts: int = 0, since: float = 0.0, metrics: bool = True
) -> dict[str, Any]:
    """The status of a job whose gang has been running since `since`; with `metrics`, its trainer
    is known to publish its step and checkpoints (dtjob's trainer)."""
    status: dict[str, Any] = {
        "phase": "Running",
        "generation": generation,
        "replicas": size,
        "readyReplicas": size,
        "restarts": restarts,
        "selector": "training.dtjob.io/job-name=gpt",
        "startTime": to_rfc3339(at(0)),
        "conditions": [
            {
                "type": "Running",
                "status": "True",
                "reason": "Running",
                "message": "",
                "lastTransitionTime": to_rfc3339(at(since)),
            },
        ],
    }
    if metrics:
        status["conditions"].append(
            {
                "type": "MetricsAvailable",
                "status": "True",
                "reason": "StepAndCheckpoints",
                "message": "rank 0 publishes its step and checkpoints",
                "lastTransitionTime": to_rfc3339(at(since)),
            }
        )
    return status


def two_nodes() -> list[dict[str, Any]]:
    return [make_node("n1"), make_node("n2")]


def observed(
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
    now: float = 100.0,
    **kw: Any,
) -> Observed:
    """The observation of these objects at `now` (node_pods: the job's own pods unless given)."""
    node_pods = kw.pop("node_pods", pods)
    return Observed(job=job, pods=pods, nodes=nodes, now=at(now), node_pods=node_pods, **kw)


def run(
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
    now: float = 100.0,
    settings: ReconcilerSettings | None = None,
    **kw: Any,
) -> list[Action]:
    """One reconcile of this observation, with the default settings unless given."""
    return reconcile(observed(job, pods, nodes, now, **kw), settings or ReconcilerSettings())


def status_patch(actions: list[Action]) -> dict[str, Any]:
    patches = [a for a in actions if isinstance(a, PatchStatus)]
    assert len(patches) <= 1, patches
    if patches:
        assert actions[0] is patches[0], "the status patch must come before every other action"
    return patches[0].status if patches else {}


def applied(job: dict[str, Any], actions: list[Action]) -> dict[str, Any]:
    """The job after its status patch."""
    out = copy.deepcopy(job)
    out.setdefault("status", {}).update(status_patch(actions))
    return out


def condition(actions: list[Action], ctype: str) -> dict[str, Any] | None:
    """The condition of type `ctype` as the status patch writes it (None: not written)."""
    conditions = status_patch(actions).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), None)


def waiting(actions: list[Action]) -> tuple[str, str] | None:
    """(reason, message) of the Waiting condition the patch sets True; None: not set True."""
    cond = condition(actions, "Waiting")
    return (cond["reason"], cond["message"]) if cond and cond["status"] == "True" else None


def creates(actions: list[Action]) -> list[CreatePod]:
    return [a for a in actions if isinstance(a, CreatePod)]


def deletes(actions: list[Action]) -> list[DeletePod]:
    return [a for a in actions if isinstance(a, DeletePod)]


def events(actions: list[Action]) -> list[EmitEvent]:
    return [a for a in actions if isinstance(a, EmitEvent)]


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    return {e["name"]: e["value"] for e in trainer["env"]}


def seen_through(
    job: dict[str, Any], cached: list[dict[str, Any]], expectations: Expectations, nodes: list[dict[str, Any]]
) -> Observed:
    """What a pass observes now of the job "ml/gpt": the cached pods through the writes in flight."""
    now = datetime.now(UTC)
    expected = expectations.pending(("ml", "gpt"))
    in_flight = sum(len(writes) for writes in expected.values())
    pods = overlay(cached, expected, now)
    return Observed(job=job, pods=pods, nodes=nodes, now=now, pod_writes_in_flight=in_flight)


def settle(condition: Callable[[], bool], timeout: float = 10) -> None:
    """Waits for the pass runner's threads to make `condition` true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
