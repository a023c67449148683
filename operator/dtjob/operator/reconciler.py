"""The pure reconciler: observed job, pods and nodes in; the actions that converge them out.

No I/O happens here. `reconcile(Observed(...), settings)` looks at the job's status (its memory:
phase, generation, world size, restarts, what the trainer publishes), at the worker pods carrying
its job-name label, and at the nodes, and returns the actions of `dtjob.operator.actions`. It is
level-triggered: whatever happened before (an operator killed half-way, missed events), the same
observation gives the same decision, and applying it twice does no harm (pod names are fixed per
rank, so a second create is an AlreadyExists, never a duplicate).

The rules, in the order they are checked:

1. A finished job (Succeeded/Failed) only cleans up pods (cleanPodPolicy) and is deleted after
   ttlSecondsAfterFinished.
2. A new job starts generation 0 at the desired world size (or Suspended when spec says so).
   2a. Not while another live job of its namespace owns its checkpoint directory (an older one,
   or one that started first; see dtjob.operator.ownership): it waits, with no pods, Waiting
   CheckpointDirInUse and a Warning event naming that job, until the owner finishes or is gone.
3. activeDeadlineSeconds past startTime fails the job.
4. suspend deletes the pods gracefully (the trainer checkpoints and exits 75); resuming starts a
   new generation, not counted as a restart.
5. Pods of an older generation are deleted; the new generation's pods are created only after the
   old ones are gone (they share names, and the old rank 0 owns MASTER_ADDR until it exits). A
   deletion that a Ready node's kubelet leaves unfinished 5 s past its grace period (2 s for a
   rank its peers declared lost; a node gone silent, not NotReady yet) is forced, and new
   workers avoid that node (status.silentNodes) until it turns NotReady or renews its Lease.
6. In the current generation: a permanent exit code fails the job; all workers exiting 0 succeeds
   it; a failed, deleted or node-lost worker, survivors exiting 76 (a lost peer, named from their
   logs), or a step that did not advance for progressDeadlineSeconds start a new generation
   (restarts += 1, the job fails once restarts would exceed maxRestarts) sized to what fits now,
   never below minReplicas; a worker that exited 75 on its own (stopped with a checkpoint) or that
   the scheduler preempted restarts the gang uncounted, and its peers get their full grace period
   to checkpoint. Restarts the pods' agents made in place (elastic.restartInPlace; rank 0's
   metrics, or a failed pod's agent's last line) count in restarts as well.
7. Pods unschedulable past the elastic scheduling timeout shrink the job to what fits (planned);
   a Volcano gang whose members would fit waits instead (its queue or priority holds it).
8. A healthy gang whose world size differs from the desired one rescales (planned): down at
   once on `kubectl scale`, up when the capacity is there, after the generation's first
   checkpoint when the trainer reports checkpoints (condition MetricsAvailable).

Whenever a rule holds something back, the condition Waiting says what for (old workers to exit,
workers to run, capacity, a checkpoint, rank 0's metrics, suspend to end, a valid spec). A
Volcano job's PodGroup follows the generation (minMember = its world size, see gang.py), and the
scheduler's view of it is the job's GangScheduled condition.

A job started by this operator keeps accounts on its status (dtjob.operator.accounting): rank 0's
progress and ETA, the goodput of its wall time, and its recoveries, each opened with a new gang
(or a restart in place) and closed, with a GangRecovered event, once the next gang steps.

`plan()` also says when the next pass is needed without any event (controller-runtime's
RequeueAfter): `Plan.wake_at`, the first moment at which time alone changes the decision (a
deadline, a TTL, a hold, a grace period running out), and `Plan.poll`, set while the decision
waits on what no watch of the operator announces (capacity that other jobs free, Volcano's
queue). Every other change comes as an event: a pod, a node, the job's spec, rank 0's new step.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from dtjob import contract
from dtjob.api import JobPhase, validate_job
from dtjob.operator import accounting, gang, in_place, manifests, ownership, recoveries
from dtjob.operator.actions import (
    Action,
    ApplyPodGroup,
    CountRescale,
    CountRestart,
    CreatePod,
    CreateService,
    DeleteJob,
    DeletePod,
    EmitEvent,
    JobRecovered,
    JobRestarted,
    ObserveRecovery,
    PatchStatus,
)
from dtjob.operator.capacity import node_is_ready, workers_that_fit
from dtjob.operator.jobview import EXIT_CHECKPOINTED, LABEL_GENERATION, LABEL_RANK, JobView
from dtjob.operator.progress import (
    METRICS_AVAILABLE,
    TrainerProgress,
    metrics_availability,
    publishes_checkpoints,
    publishes_step,
    stalled_for,
)
from dtjob.operator.settings import ReconcilerSettings
from dtjob.operator.timefmt import from_rfc3339, to_rfc3339

# The job's phases; status.phase is written by _Pass.set_phase only.
PENDING, RUNNING, RESTARTING = JobPhase.PENDING, JobPhase.RUNNING, JobPhase.RESTARTING
SUCCEEDED, FAILED, SUSPENDED = JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.SUSPENDED
CHECKPOINT_WRITE_FAILING = "CheckpointWriteFailing"
FINISHED = {SUCCEEDED, FAILED}
# Restart reasons that are failures (not planned rescales): time to recover is measured for these.
FAILURE_REASONS = {
    "WorkerFailed", "WorkerDeleted", "NodeLost", "WorkerStopped", "PeerLost", "ProgressDeadlineExceeded"
}  # fmt: skip
WAITING = "Waiting"
# A kubelet kills a deleted pod's containers at the end of its grace period and the pod is gone
# within about a second (the nodelet: 0.05 s; a loaded kubelet: 1-2 s; KWOK deleting 1,024 pods at
# once: up to 12 s); 5 s later it is taken for silent. A rank its peers declared lost (deleted with
# LOST_RANK_GRACE_SECONDS) is suspect already, and waits 2 s: 3 s less of every node loss before
# the next gang starts (at 2 s for every pod, KWOK's 1,024-pod deletions were taken for 128 silent
# nodes). The node is avoided by new workers for 120 s (a silent node turns NotReady within the
# node controller's grace, 20 s here and 40-50 s on a default cluster), or until it turns NotReady,
# is Ready again after a transition, or renews its Lease: a live kubelet taken for silent renews
# it within 10 s (the nodelet: 4 s), so a false alarm costs its node seconds, not minutes.
SILENT_KUBELET_SECONDS = 5
SILENT_LOST_RANK_SECONDS = 2
SILENT_NODE_AVOID_SECONDS = 120
# Failures named one by one in a message; beyond them, the message counts the rest.
LISTED = 3
EXIT_PEER_LOST = contract.EXIT_PEER_LOST


@dataclass(frozen=True)
class Plan:
    """A pass's decision: the actions, and when the job needs its next pass if nothing happens."""

    actions: list[Action]
    # The first moment after `now` at which time alone changes the decision (None: never).
    wake_at: datetime | None = None
    # Waiting on a change no watch announces (capacity, a Volcano queue): look again periodically.
    poll: bool = False
    # Pod writes were left over (ReconcilerSettings.pod_writes_per_pass): the next pass as soon as
    # the job has at most one pass's worth in flight.
    more: bool = False
    # The only action is a status patch that moves nothing but the workers' progress (readyReplicas,
    # the message of a Waiting condition whose reason stays): the runner may write it later.
    progress_only: bool = False


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
    # spec.renewTime of the node Leases (kube-node-lease) of the nodes in status.silentNodes and of
    # the nodes of workers whose deletion may be found silent (`silent_deletion`), by node name
    # (absent: not read).
    leases: Mapping[str, str] = field(default_factory=dict)
    # The job's pod creations and deletions sent by earlier passes and not answered yet (`pods`
    # shows them as done, see dtjob.operator.expectations): they count against this pass's.
    pod_writes_in_flight: int = 0
    # The other live jobs of the namespace whose checkpoint directory overlaps the job's
    # (dtjob.operator.ownership); read only for a job that has not started (rule 2a).
    checkpoint_claims: Sequence[ownership.Claim] = ()


def with_condition(
    conditions: Sequence[Mapping[str, Any]],
    ctype: str,
    value: bool | None,
    reason: str,
    message: str,
    now: datetime,
) -> list[dict[str, Any]]:
    """`conditions` with the one of type `ctype` set (value None: status Unknown);
    lastTransitionTime moves only when the status changes."""
    updated = [dict(c) for c in conditions]
    wanted = "Unknown" if value is None else "True" if value else "False"
    for cond in updated:
        if cond.get("type") == ctype:
            if cond.get("status") != wanted:
                cond["lastTransitionTime"] = to_rfc3339(now)
            cond.update(status=wanted, reason=reason, message=message)
            return updated
    new = {"type": ctype, "status": wanted, "reason": reason, "message": message}
    return [*updated, {**new, "lastTransitionTime": to_rfc3339(now)}]


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
        meta = pod.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if not rv or not meta.get("uid"):
            return cls._parse(pod)
        key = (meta.get("uid"), rv, meta.get("deletionTimestamp"), meta.get("deletionGracePeriodSeconds"))
        worker = _PARSED.get(key)
        if worker is None:
            if len(_PARSED) >= PARSED_LIMIT:
                _PARSED.clear()
            worker = _PARSED[key] = cls._parse(pod)
        return worker

    @classmethod
    def _parse(cls, pod: Mapping[str, Any]) -> Worker:
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
            scheduled=_condition_time(status, "PodScheduled"),
            deletion_deadline=from_rfc3339(meta.get("deletionTimestamp")),
            deletion_grace=meta.get("deletionGracePeriodSeconds"),
            finished=finished,
        )

    @property
    def terminal(self) -> bool:
        return self.phase in {"Succeeded", "Failed"}


# Workers parsed from pods, by (uid, resourceVersion, deletionTimestamp,
# deletionGracePeriodSeconds): a resourceVersion names one content of a pod, and the expectation
# of a deletion in flight (dtjob.operator.expectations) changes only the last two. A pass of a
# 1,024-worker job parsed every pod again, 12-25 ms of its 26-50 ms, several times a second while
# the gang's pods change. Pods without a version (creations in flight, tests) are parsed each time.
_PARSED: dict[tuple[Any, ...], Worker] = {}
PARSED_LIMIT = 65536


def _condition_time(status: Mapping[str, Any], ctype: str, value: str | None = "True") -> datetime | None:
    """lastTransitionTime of an object's condition of type ctype (with that status, unless None)."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == ctype and value in (None, condition.get("status")):
            return from_rfc3339(condition.get("lastTransitionTime"))
    return None


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Failure:
    worker: Worker
    # WorkerFailed, WorkerDeleted, NodeLost, WorkerStopped, Preempted, PeerLost, ProgressDeadlineExceeded
    reason: str
    message: str
    counted: bool  # counts towards maxRestarts
    lost_rank: int | None = None  # PeerLost: the rank its log names


@dataclass
class _Pass:
    """One reconcile pass: the status being built and the actions being collected."""

    obs: Observed
    settings: ReconcilerSettings
    job: JobView
    status: dict[str, Any]
    actions: list[Action] = field(default_factory=list)
    events: list[EmitEvent] = field(default_factory=list)
    waiting: tuple[str, str] | None = None  # (reason, message) of the Waiting condition
    wake: datetime | None = None  # see Plan.wake_at
    poll: bool = False  # see Plan.poll
    # status.silentNodes still avoided: node name -> its entry ({name, since, leaseRenewTime}),
    # see _silent_nodes
    silent: dict[str, dict[str, str]] = field(default_factory=dict)
    more: bool = False  # pod creations left out beyond the pass's budget, see Plan.more

    @property
    def pod_write_budget(self) -> int:
        """Pod creations and deletions this pass may send: pod_writes_per_pass, and no more than
        twice that in flight for the job (the writes of earlier passes still unanswered)."""
        limit = self.settings.pod_writes_per_pass
        return max(0, min(limit, 2 * limit - self.obs.pod_writes_in_flight))

    @functools.cached_property
    def nodes(self) -> dict[str, Mapping[str, Any]]:
        """The observed nodes by name (a 1,024-worker pass looks up each worker's node)."""
        return {str((n.get("metadata") or {}).get("name")): n for n in self.obs.nodes}

    @property
    def now(self) -> datetime:
        return self.obs.now

    def wake_at(self, moment: datetime, strict: bool = False) -> None:
        """Time alone changes this pass's decision at `moment`, or just after it for a rule that
        compares with `>` (`strict`); ignored when that is not in the future."""
        if strict:
            moment += timedelta(microseconds=1)
        if moment > self.now and (self.wake is None or moment < self.wake):
            self.wake = moment

    def condition(self, ctype: str) -> dict[str, Any] | None:
        for cond in self.status.get("conditions") or []:
            if cond.get("type") == ctype:
                return dict(cond)
        return None

    def set_condition(self, ctype: str, value: bool | None, reason: str, message: str) -> None:
        conditions = self.status.get("conditions") or []
        self.status["conditions"] = with_condition(conditions, ctype, value, reason, message, self.now)

    def wait(self, reason: str, message: str) -> None:
        """Say what the operator waits for (condition Waiting); the first wait of a pass wins."""
        if self.waiting is None:
            self.waiting = (reason, message)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(EmitEvent("Warning" if warning else "Normal", reason, message))

    def set_phase(self, phase: JobPhase, reason: str, message: str, warning: bool = False) -> None:
        """Record a transition, the one place status.phase is written: the phase (as its plain
        string), the matching condition (Pending has none), an Event saying why."""
        previous = self.status.get("phase")
        self.status["phase"] = phase.value
        for ctype in (RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED):
            if ctype == phase:
                self.set_condition(ctype.value, True, reason, message)
            elif (self.condition(ctype) or {}).get("status") == "True":
                self.set_condition(ctype.value, False, reason, message)
        if previous != phase or phase == RESTARTING:
            self.event(reason, message, warning)

    def node_lost(self, w: Worker) -> bool:
        """Whether w is bound to a node that is gone or NotReady."""
        if not w.node_name:
            return False
        node = self.nodes.get(w.node_name)
        if node is None:
            return True
        if node_is_ready(node):
            return False
        # A pod bound after the NotReady transition seen here: the node came back and this view
        # lags, until node_view_lag_seconds after the binding; later, the node is lost (a scheduler
        # binds in the moment between the transition and the node's taint; seen in chaos runs).
        since = _condition_time(node.get("status") or {}, "Ready", value=None)
        if w.scheduled is None or since is None or w.scheduled <= since:
            return True
        self.wake_at(w.scheduled + timedelta(seconds=self.settings.node_view_lag_seconds))
        return (self.now - w.scheduled).total_seconds() >= self.settings.node_view_lag_seconds

    def delete(self, w: Worker, reason: str, grace_seconds: int | None = None) -> None:
        """Delete gracefully (SIGTERM: the trainer checkpoints; grace_seconds None is the pod's
        own grace period), or force when nobody is left to run a graceful deletion: the pod
        already ended, its node is lost (a graceful deletion on a dead node would never
        complete and keep the pod's name taken), or its node's kubelet is silent. A pod deleted
        with no grace period already is left to the API server, which removes it at once (each
        pass until its watch event came deleted it again: 105 404s when 50 of 500 jobs restarted)."""
        if w.deleting and w.deletion_grace == 0:
            return
        if w.terminal or self.node_lost(w):
            self.actions.append(DeletePod(w.name, reason, grace_seconds=0))
        elif w.deleting and self.kubelet_silent(w):
            self.actions.append(DeletePod(w.name, f"{reason}; its kubelet is silent", grace_seconds=0))
            if w.node_name in self.silent:
                return  # its other pods: the node was found silent before
            self.event(
                "NodeSilent",
                f"node {w.node_name} left the deletion of {w.name} unfinished {_silent_after(w):g}s "
                f"past its grace period: deleted without it, and new workers avoid the node for "
                f"{SILENT_NODE_AVOID_SECONDS}s or until it turns NotReady or renews its Lease",
                warning=True,
            )
            entry = {"name": str(w.node_name), "since": to_rfc3339(self.now)}
            lease = self.obs.leases.get(str(w.node_name))
            if lease:
                entry["leaseRenewTime"] = lease
            self.silent[str(w.node_name)] = entry
        elif not w.deleting:
            self.actions.append(DeletePod(w.name, reason, grace_seconds=grace_seconds))

    def kubelet_silent(self, w: Worker) -> bool:
        """Whether w's node, Ready in this view, left its deletion unfinished SILENT_KUBELET_SECONDS
        past the grace period (a kubelet kills and removes a pod at its deadline, within about a
        second): a node gone silent that has not turned NotReady yet (20-50 s later)."""
        if w.deletion_deadline is None or not w.node_name:
            return False
        if w.node_name in self.silent:
            return True
        self.wake_at(w.deletion_deadline + timedelta(seconds=_silent_after(w)))
        return silent_deletion(w, self.now)


def _silent_after(w: Worker) -> float:
    """Seconds past its grace period after which w's unfinished deletion means a silent kubelet:
    SILENT_LOST_RANK_SECONDS for a rank its peers declared lost (the only deletions that get
    LOST_RANK_GRACE_SECONDS), else SILENT_KUBELET_SECONDS."""
    return SILENT_LOST_RANK_SECONDS if w.deletion_grace == LOST_RANK_GRACE_SECONDS else SILENT_KUBELET_SECONDS


def silent_deletion(w: Worker, now: datetime) -> bool:
    """Whether w's deletion is unfinished past its grace period by `_silent_after` (the observer
    reads the Leases of such workers' nodes for the pass that finds them silent)."""
    if w.deletion_deadline is None or not w.node_name:
        return False
    return now >= w.deletion_deadline + timedelta(seconds=_silent_after(w))


def reconcile(obs: Observed, settings: ReconcilerSettings) -> list[Action]:
    """Decide what to do about one job. Pure: same observation and settings, same actions."""
    return plan(obs, settings).actions


def plan(obs: Observed, settings: ReconcilerSettings) -> Plan:
    """`reconcile`'s actions, and when the job needs its next pass if nothing happens."""
    job = JobView(obs.job)
    if job.deleting:
        return Plan([])  # garbage collection removes the children through their owner references
    p = _Pass(obs, settings, job, _copy_status(job.status))
    workers = [Worker.of(pod) for pod in obs.pods]

    if p.status.get("phase") in FINISHED:
        # The clean-up policy is part of the spec: a spec the model rejects leaves the pods alone.
        if not job.spec_errors:
            _clean_up_finished(p, workers)
        return _finish(p)

    # Before anything reads job.spec (which raises on a spec the model rejects).
    problems = validate_job(dict(obs.job))
    if problems:
        # The API server's CEL rules normally stop these; an API server without them must not
        # get a broken gang either. Nothing is created until the spec is fixed.
        message = "; ".join(problems)
        if (p.condition("Valid") or {}).get("message") != message:
            p.event("InvalidSpec", message, warning=True)
        p.set_condition("Valid", False, "InvalidSpec", message)
        p.wait("InvalidSpec", "waiting for the spec to be fixed (see condition Valid)")
        return _finish(p)
    if p.condition("Valid") is not None:
        p.set_condition("Valid", True, "Valid", "the spec passes every rule")
    if p.condition(in_place.CONDITION) is not None:  # set by _start: follows the spec from then on
        _say_in_place(p)

    owner = None if p.status.get("phase") else ownership.owner_before(obs.job, obs.checkpoint_claims)
    if owner is not None:  # rule 2a: nothing is created, not even the Service
        _hold_for(p, owner)
        return _finish(p)
    _silent_nodes(p)
    if not obs.service_exists:
        p.actions.append(CreateService(manifests.headless_service(job)))
    if not p.status.get("phase"):
        _start(p)
    p.status["selector"] = job.selector

    if job.suspend:
        _suspend(p, workers)
        return _finish(p)
    if p.status.get("phase") == SUSPENDED:
        _new_generation(p, _target_size(p), "Resumed", "resumed after suspend", counted=False, phase=PENDING)
        p.status["startTime"] = to_rfc3339(p.now)  # the deadline counts from the resume, as for Jobs

    if _deadline_passed(p):
        message = f"the job ran longer than activeDeadlineSeconds={job.active_deadline_seconds}"
        _fail(p, workers, "DeadlineExceeded", message)
        for w in workers:  # past its deadline nothing of the job may keep running, whatever the policy
            if not w.terminal:
                p.delete(w, message)
        return _finish(p)

    generation = int(p.status.get("generation", 0))
    size = int(p.status.get("replicas") or 0)
    current = [w for w in workers if w.generation == generation and w.rank is not None and w.rank < size]
    _read_metrics(p)
    _track_metrics(p, current, size)
    if not _decide(p, current, workers):
        _converge_pods(p, workers, current)
    p.status["readyReplicas"] = sum(
        1
        for w in workers
        if w.generation == p.status.get("generation") and w.phase == "Running" and not w.deleting
    )
    observed = (obs.job.get("metadata") or {}).get("generation")
    if observed is not None:
        p.status["observedGeneration"] = observed
    _read_gang(p, [w for w in workers if w.generation == p.status.get("generation")])
    return _finish(p)


def _copy_status(status: Mapping[str, Any]) -> dict[str, Any]:
    copied = {k: v for k, v in status.items()}
    copied["conditions"] = [dict(c) for c in status.get("conditions") or []]
    return copied


def _finish(p: _Pass) -> Plan:
    """The status patch (when anything changed), then the events, then the other actions."""
    if p.silent or p.status.get("silentNodes"):
        p.status["silentNodes"] = [entry for _, entry in sorted(p.silent.items())]
    if p.waiting is not None:
        p.set_condition(WAITING, True, *p.waiting)
    elif (p.condition(WAITING) or {}).get("status") == "True":
        p.set_condition(WAITING, False, "NotWaiting", "nothing to wait for")
    before = p.job.status
    changed = {k: v for k, v in p.status.items() if before.get(k) != v}
    if changed.get("conditions") == [] and not before.get("conditions"):
        changed.pop("conditions")
    head: list[Action] = [PatchStatus(changed)] if changed else []
    actions, more = _first_pod_writes(p.actions, p.pod_write_budget)
    progress = bool(changed) and not p.events and not actions and _progress_only(before, changed)
    # Events right after the status they explain: a later action failing must not swallow them.
    return Plan([*head, *p.events, *actions], p.wake, p.poll, more or p.more, progress)


def _progress_only(before: Mapping[str, Any], changed: Mapping[str, Any]) -> bool:
    """Whether a status patch only moves the workers' progress: readyReplicas, and of the
    conditions only the message of Waiting, under the same status and reason ("waiting for 3 of 4
    workers" after "waiting for 4 of 4")."""
    if not set(changed) <= {"readyReplicas", "conditions"}:
        return False
    if "conditions" not in changed:
        return True
    old = {c.get("type"): c for c in before.get("conditions") or []}
    new = {c.get("type"): c for c in changed["conditions"]}
    if set(old) != set(new):
        return False
    for ctype, cond in new.items():
        was = old[ctype]
        if cond == was:
            continue
        if ctype != WAITING or (cond.get("status"), cond.get("reason")) != (
            was.get("status"),
            was.get("reason"),
        ):
            return False
    return True


def _first_pod_writes(actions: list[Action], limit: int) -> tuple[list[Action], bool]:
    """The actions with only their first `limit` pod creations and deletions, and whether any
    were left out (the next pass decides them again, from the state the first ones made)."""
    kept: list[Action] = []
    writes = 0
    for action in actions:
        if isinstance(action, (CreatePod, DeletePod)):
            writes += 1
            if writes > limit:
                continue
        kept.append(action)
    return kept, writes > limit


def _start(p: _Pass) -> None:
    p.status.update(generation=0, restarts=0, startTime=to_rfc3339(p.now))
    _say_in_place(p)
    accounting.start(p.status, p.now)
    if p.job.suspend:
        p.status["replicas"] = 0
        p.set_phase(
            SUSPENDED, "Suspended", "created suspended: no worker runs until spec.runPolicy.suspend is false"
        )
        return
    size = p.job.desired_replicas
    p.status["replicas"] = size
    p.status["worldSize"] = size * p.job.nproc_per_worker
    p.set_phase(PENDING, "Created", f"generation 0: creating {size} workers")  # its Event: Created
    p.set_condition("Created", True, "Created", f"generation 0: creating {size} workers")


def _hold_for(p: _Pass, owner: ownership.Claim) -> None:
    """Rule 2a: wait for the owner of the checkpoint directory; a Warning event when the message
    is new. The owner finishing triggers this job (dtjob.operator.cache); its last pods stopping
    do not, so the job is looked at again every tick."""
    message = ownership.held_message(p.obs.job, owner)
    if (p.condition(WAITING) or {}).get("message") != message:
        p.event(ownership.REASON, message, warning=True)
    p.wait(ownership.REASON, message)
    p.poll = True


def _say_in_place(p: _Pass) -> None:
    """Condition RestartInPlace: on or off, and why (dtjob.operator.in_place), so that a job never
    goes without restarts in place unsaid."""
    rule = p.job.restart_in_place_rule
    p.set_condition(in_place.CONDITION, rule.on, rule.reason, rule.message)


def _deadline_passed(p: _Pass) -> bool:
    deadline = p.job.active_deadline_seconds
    started = from_rfc3339(p.status.get("startTime"))
    if deadline is None or started is None:
        return False
    p.wake_at(started + timedelta(seconds=deadline), strict=True)
    return (p.now - started).total_seconds() > deadline


def _fail(p: _Pass, workers: Sequence[Worker], reason: str, message: str) -> None:
    p.status["completionTime"] = to_rfc3339(p.now)
    _recovered(p, accounting.finished(p.status, p.now, succeeded=False))
    p.set_phase(FAILED, reason, message, warning=True)
    _clean_up_finished(p, workers)


def _succeed(p: _Pass, workers: Sequence[Worker]) -> None:
    p.status["completionTime"] = to_rfc3339(p.now)
    checkpoint_step = (p.status.get("lastCheckpoint") or {}).get("step")
    if checkpoint_step is not None:
        p.status["step"] = max(int(p.status.get("step") or 0), int(checkpoint_step))
    _recovered(p, accounting.finished(p.status, p.now, succeeded=True))
    if (p.condition(CHECKPOINT_WRITE_FAILING) or {}).get("status") == "True":
        # the last step's checkpoint is never skipped: a trainer that exits 0 wrote it
        message = f"the last step's checkpoint was written (step {p.status.get('step')})"
        p.set_condition(CHECKPOINT_WRITE_FAILING, False, "NoRefusedWrites", message)
    p.set_phase(
        SUCCEEDED,
        "Succeeded",
        f"all {len(workers)} workers of generation {p.status.get('generation')} exited 0",
    )
    _clean_up_finished(p, workers)


def _clean_up_finished(p: _Pass, workers: Sequence[Worker]) -> None:
    policy = p.job.clean_pod_policy
    for w in workers:
        if w.deleting:
            continue
        if policy == "All" or (policy == "Running" and not w.terminal):
            p.actions.append(DeletePod(w.name, f"job finished, cleanPodPolicy={policy}"))
    ttl = p.job.ttl_seconds_after_finished
    done = from_rfc3339(p.status.get("completionTime"))
    if ttl is None or done is None:
        return
    p.wake_at(done + timedelta(seconds=ttl))
    if (p.now - done).total_seconds() >= ttl:
        p.actions.append(DeleteJob(f"finished {ttl}s ago (ttlSecondsAfterFinished)"))


def _suspend(p: _Pass, workers: Sequence[Worker]) -> None:
    if p.status.get("phase") != SUSPENDED:
        p.set_phase(SUSPENDED, "Suspended", "spec.runPolicy.suspend is true: workers checkpoint and stop")
    for w in workers:
        p.delete(w, "job suspended")
    stopping = f"; {len(workers)} workers still stopping" if workers else ""
    p.wait("Suspended", f"waiting for spec.runPolicy.suspend to be false{stopping}")


def _silent_nodes(p: _Pass) -> None:
    """The nodes of status.silentNodes new workers still avoid: found silent less than
    SILENT_NODE_AVOID_SECONDS ago, Ready without a transition since (a NotReady node is avoided by
    the scheduler itself, and one Ready again after it was NotReady came back: no pass may have
    run while it was NotReady, so its Ready condition's transition time tells), and with the same
    Lease renewTime as when it was found silent (another one: its kubelet is alive; the time
    itself, the node's clock, is never compared with the operator's)."""
    nodes = p.nodes
    for entry in p.status.get("silentNodes") or []:
        name = str(entry.get("name"))
        since = from_rfc3339(entry.get("since"))
        node = nodes.get(name)
        if since is None or node is None or not node_is_ready(node):
            continue
        changed = _condition_time(node.get("status") or {}, "Ready", value=None)
        if changed is not None and changed > since:
            continue
        then, lease = entry.get("leaseRenewTime"), p.obs.leases.get(name)
        if then and lease and lease != then:
            continue
        until = since + timedelta(seconds=SILENT_NODE_AVOID_SECONDS)
        p.wake_at(until)
        if p.now < until:
            p.silent[name] = {k: str(v) for k, v in entry.items()}
            # A Lease renewal is announced by no watch of the operator's: look again every tick.
            p.poll = p.poll or bool(then)


def _capacity(p: _Pass) -> int:
    nodes = [n for n in p.obs.nodes if (n.get("metadata") or {}).get("name") not in p.silent]
    return workers_that_fit(p.job.name, p.job.template, nodes, p.obs.node_pods)


def _target_size(p: _Pass) -> int:
    """The world size of a new generation: desired if it fits, else what fits, never below min."""
    fits = _capacity(p)
    job = p.job
    size = max(job.min_replicas, min(job.desired_replicas, fits))
    if fits < job.min_replicas:
        p.set_condition(
            "Schedulable",
            False,
            "InsufficientCapacity",
            f"only {fits} workers fit on Ready nodes, fewer than minReplicas={job.min_replicas}: "
            f"waiting for capacity at {size} workers",
        )
        p.wait("Capacity", f"waiting for capacity: {fits} workers fit, minReplicas is {job.min_replicas}")
        p.poll = True
    else:
        p.set_condition("Schedulable", True, "Fits", f"{fits} workers fit on Ready nodes")
    return size


def _new_generation(
    p: _Pass,
    size: int,
    reason: str,
    message: str,
    *,
    counted: bool,
    phase: JobPhase = RESTARTING,
    failed_at: datetime | None = None,
    exit_code: int | None = None,
) -> None:
    """Start the next gang: recorded in status first; old pods are deleted by _converge_pods.
    `failed_at` and `exit_code`: what the job's recovery record says of the failure."""
    old_size = int(p.status.get("replicas") or 0)
    generation = int(p.status.get("generation", -1)) + 1
    p.status["generation"] = generation
    p.status["replicas"] = size
    p.status["worldSize"] = size * p.job.nproc_per_worker
    if p.job.restart_in_place:
        p.status["inPlaceRestarts"] = 0  # the new generation's agents count from 0
    if counted:
        p.status["restarts"] = int(p.status.get("restarts") or 0) + 1
        p.actions.append(CountRestart(reason))
    text = f"generation {generation} with {size} workers: {message}"
    p.set_phase(phase, reason, text, warning=counted)
    if reason != "Resumed" and old_size:  # a resume after suspend is the user's pause, not a recovery
        _restarted(p, reason, failed_at, exit_code, planned=not counted, size_before=old_size)
    if old_size and size != old_size:
        direction = "up" if size > old_size else "down"
        p.actions.append(CountRescale(direction, reason))
        if reason not in {"ScaleUp", "ScaleDown"}:
            p.event("Rescale", f"world size {old_size} -> {size}: {message}")


def _failures(p: _Pass, current: Sequence[Worker]) -> list[Failure]:
    nodes = p.nodes
    found: list[Failure] = []
    for w in current:
        if w.phase == "Succeeded":
            continue
        if w.node_name and w.node_name not in nodes:
            found.append(Failure(w, "NodeLost", f"node {w.node_name} of {w.name} is gone", True))
        elif w.node_name and not w.terminal and p.node_lost(w):
            found.append(Failure(w, "NodeLost", f"node {w.node_name} of {w.name} is NotReady", True))
        elif w.preempted is not None and (w.deleting or w.terminal):
            # planned by the scheduler, whatever the exit code its SIGTERM ended in
            found.append(Failure(w, "Preempted", f"{w.name} was preempted: {w.preempted}", False))
        elif w.phase == "Failed" and w.exit_code == EXIT_CHECKPOINTED:
            found.append(Failure(w, "WorkerStopped", f"{w.name} stopped after a checkpoint (exit 75)", False))
        elif w.phase == "Failed" and w.exit_code == EXIT_PEER_LOST:
            lost = contract.parse_peer_lost_line((w.message or "") + "\n" + p.obs.worker_logs.get(w.name, ""))
            found.append(Failure(w, "PeerLost", f"{w.name} exited {EXIT_PEER_LOST} (peer lost)", True, lost))
        elif w.phase == "Failed":
            how = f"exit code {w.exit_code}" if w.exit_code is not None else (w.reason or "no exit code")
            said = contract.last_words(w.message or "") or contract.last_words(
                p.obs.worker_logs.get(w.name, "")
            )
            found.append(
                Failure(w, "WorkerFailed", f"{w.name} failed ({how})" + (f": {said}" if said else ""), True)
            )
        elif w.deleting:
            found.append(Failure(w, "WorkerDeleted", f"{w.name} was deleted", True))
    return found


def _decide(p: _Pass, current: Sequence[Worker], workers: Sequence[Worker]) -> bool:
    """Rules 6-8 on the current generation. Returns True when the pass is done (a new
    generation was started, or the job finished)."""
    job = p.job
    size = int(p.status.get("replicas") or 0)
    failures = _failures(p, current)

    if not failures:
        stall = _stalled(p, current, size)
        failures = [stall] if stall is not None else []

    for f in failures:
        code = f.worker.exit_code
        if f.reason not in {"WorkerFailed", "PeerLost"}:
            continue
        if job.restart_policy == "Never":
            _fail(p, workers, "RestartPolicyNever", f"{f.message}; elastic.restartPolicy is Never")
            return True
        if code is not None and job.is_permanent_exit_code(code):
            _fail(
                p,
                workers,
                "PermanentError",
                f"{f.message}; exit code {code} is permanent (permanentExitCodes)",
            )
            return True

    succeeded = [w for w in current if w.phase == "Succeeded"]
    if not failures and size > 0 and len(succeeded) == size and len(current) == size:
        _succeed(p, current)
        return True

    if failures:
        counted = any(f.counted for f in failures)
        message = _describe(p, failures)
        agents_said = [
            contract.parse_in_place_line(p.obs.worker_logs.get(f.worker.name, "")) for f in failures
        ]
        _count_in_place(p, max((n for n in agents_said if n is not None), default=0), None, account=False)
        restarts = int(p.status.get("restarts") or 0)
        if counted and restarts + 1 > job.max_restarts:
            p.status["restarts"] = restarts + 1
            limit = f"restart {restarts + 1} would exceed maxRestarts={job.max_restarts}"
            _fail(p, workers, "MaxRestartsExceeded", f"{message}; {limit}")
            return True
        # The cause, not its echo: survivors exit PeerLost because of another failure; a preemption
        # names an uncounted restart.
        causes = [f for f in failures if f.counted and f.reason != "PeerLost"] or failures
        preempted = next((f.reason for f in failures if f.reason == "Preempted"), causes[0].reason)
        reason = next((f.reason for f in causes if f.counted), preempted)
        cause = next(f for f in failures if f.reason == reason)
        _new_generation(p, _target_size(p), reason, message, counted=counted,
                        failed_at=_failed_at(p, failures), exit_code=cause.worker.exit_code)  # fmt: skip
        # A planned stop (preemption, a worker's own exit 75): the others checkpoint first, with
        # their full grace period; after a failure they cannot (a peer is gone).
        lost = {f.lost_rank for f in failures if f.reason == "PeerLost" and f.lost_rank is not None}
        grace = p.settings.unplanned_stop_grace_seconds if counted else None
        _delete_all(p, workers, grace, lost={w.name for w in current if w.rank in lost})
        return True

    if p.status.get("phase") == RESTARTING and any(
        w.generation != p.status.get("generation") for w in workers
    ):
        return False  # still removing the old generation

    unscheduled = [w for w in current if w.phase == "Pending" and not w.node_name and not w.deleting]
    if unscheduled and len(current) == size:
        return _maybe_shrink(p, unscheduled, workers, size)

    running = [w for w in current if w.phase == "Running" and not w.deleting]
    if size > 0 and len(running) == size:
        return _maybe_rescale(p, workers, size)
    return False


def _maybe_shrink(p: _Pass, unscheduled: Sequence[Worker], workers: Sequence[Worker], size: int) -> bool:
    job = p.job
    waiting_since = min((w.created for w in unscheduled if w.created), default=None)
    if waiting_since is None:
        return False
    p.wake_at(waiting_since + timedelta(seconds=job.scheduling_timeout_seconds))
    if (p.now - waiting_since).total_seconds() < job.scheduling_timeout_seconds:
        return False
    p.poll = True  # past the timeout, what fits changes with the other jobs' pods
    fits = _capacity(p)
    if job.uses_podgroup and fits >= size:
        # Volcano places the gang whole or not at all, and the nodes have room for it: what
        # holds it is its queue (capability, other jobs) or priority, not capacity, and a
        # smaller gang would wait in the same queue.
        return False
    scheduled = size - len(unscheduled)
    candidate = fits if fits < size else scheduled
    target = max(job.min_replicas, min(candidate, size - 1))
    if target >= size:
        p.set_condition(
            "Schedulable",
            False,
            "InsufficientCapacity",
            f"{len(unscheduled)} of {size} workers unschedulable for more than "
            f"{job.scheduling_timeout_seconds:g}s and the job is at minReplicas={job.min_replicas}: "
            "waiting for capacity",
        )
        p.wait("Capacity", f"waiting for capacity: {len(unscheduled)} of {size} workers unschedulable")
        return False
    p.set_condition(
        "Schedulable", False, "Unschedulable", f"{len(unscheduled)} of {size} workers did not fit"
    )
    _new_generation(
        p,
        target,
        "Unschedulable",
        f"{len(unscheduled)} of {size} workers unschedulable for more than "
        f"{job.scheduling_timeout_seconds:g}s; shrinking to what fits",
        counted=False,
    )
    # A gang with unscheduled members never got past its rendezvous: nothing to checkpoint.
    _delete_all(p, workers, p.settings.unplanned_stop_grace_seconds)
    return True


def _maybe_rescale(p: _Pass, workers: Sequence[Worker], size: int) -> bool:
    job = p.job
    desired = job.desired_replicas
    if size > desired:
        _new_generation(p, desired, "ScaleDown", f"spec.replicas is {job.replicas}", counted=False)
        _delete_all(p, workers)
        return True
    if size == desired:
        return False
    fits = _capacity(p)
    target = min(desired, fits)
    if target <= size:
        p.wait("Capacity", f"waiting for capacity to grow from {size} to {desired} workers: {fits} fit")
        p.poll = True
        return False
    running_since = from_rfc3339((p.condition(RUNNING) or {}).get("lastTransitionTime"))
    hold = p.settings.grow_hold_seconds
    if running_since is not None:
        p.wake_at(running_since + timedelta(seconds=hold))
    if running_since is not None and (p.now - running_since).total_seconds() < hold:
        # No running seconds in the message: it would change (a status write) on every pass.
        p.wait(
            "RescaleHold",
            f"generation {p.status.get('generation')} runs at {size} workers; it grows to {target} "
            f"once it has run {hold:g}s",
        )
        return False
    if not _checkpointed_since(p, running_since, f"growing from {size} to {target} workers"):
        return False
    _new_generation(p, target, "ScaleUp", f"capacity for {fits} workers, desired {desired}", counted=False)
    p.set_condition("Schedulable", True, "Fits", f"{fits} workers fit on Ready nodes")
    _delete_all(p, workers)
    return True


def _checkpointed_since(p: _Pass, since: datetime | None, doing: str) -> bool:
    """Whether the current generation's progress is safe from a planned rescale: a checkpoint
    written since it started running, or nothing to wait for (no checkpoint storage, or a trainer
    that does not report its checkpoints: it gets SIGTERM and its grace period, as any trainer).
    Says what it waits for otherwise."""
    if p.job.checkpoint_volume is None or since is None:
        return True
    written = from_rfc3339((p.status.get("lastCheckpoint") or {}).get("time"))
    if written is not None and written >= since:
        return True
    reports = publishes_checkpoints(
        p.condition(METRICS_AVAILABLE), p.status.get("lastCheckpoint") is not None
    )
    if reports is False:
        return True
    generation = p.status.get("generation")
    if reports is None:
        grace = p.settings.metrics_grace_seconds
        p.wait(
            "TrainerMetrics",
            f"waiting up to {grace:g}s of running for rank 0's metrics, to know whether the trainer "
            f"reports checkpoints, before {doing}",
        )
    else:
        p.wait(
            "Checkpoint",
            f"waiting for generation {generation}'s first checkpoint before {doing} (a rescale before "
            "it would lose the steps since the generation started)",
        )
    return False


# The grace of a rank its peers declared lost (no heartbeat): hung, cut off, or on a silent
# node, it cannot act on SIGTERM. A live kubelet kills it and confirms within about a second (the
# next generation, whose pod takes its name, waited the 5 s unplanned grace before); a silent
# node never confirms, and the pod waits for the node's NotReady, as a force deletion would not:
# that let the scheduler place the next gang on the silent node, which still looked Ready, and
# cost a second restart at its NotReady (seen in the chaos run).
LOST_RANK_GRACE_SECONDS = 1


def _delete_all(
    p: _Pass, workers: Sequence[Worker], grace_seconds: int | None = None, lost: Collection[str] = ()
) -> None:
    """Delete every worker; those named in `lost` with LOST_RANK_GRACE_SECONDS."""
    for w in workers:
        reason = f"stopping generation {w.generation} for generation {p.status.get('generation')}"
        if w.name in lost:
            reason = f"rank {w.rank} lost by its peers (no heartbeat), {reason}"
        p.delete(w, reason, LOST_RANK_GRACE_SECONDS if w.name in lost else grace_seconds)


def _converge_pods(p: _Pass, workers: Sequence[Worker], current: Sequence[Worker]) -> None:
    """Delete pods of old generations; once they are gone, create the current one's missing pods
    and mark the job Running when every worker runs."""
    job = p.job
    generation = int(p.status.get("generation", 0))
    size = int(p.status.get("replicas") or 0)
    old = [w for w in workers if w.generation != generation or w.rank is None or w.rank >= size]
    for w in old:
        p.delete(w, f"generation {w.generation} replaced by generation {generation}")
    if old:
        generations = ", ".join(sorted({str(w.generation) for w in old}))
        p.wait(
            "OldWorkers",
            f"waiting for {len(old)} workers of generation {generations} to exit before starting "
            f"generation {generation} (they share its pod names)",
        )
        return
    if not current and p.silent and p.status.get("phase") == RESTARTING:
        size = _fit_beside_silent_nodes(p, size)

    if job.uses_podgroup:
        # Before the generation's pods: Volcano must see their minMember before it sees them.
        wanted = manifests.podgroup(job, size)
        have = p.obs.podgroup
        if have is None or gang.spec_differs(have, wanted):
            p.actions.append(ApplyPodGroup(wanted, exists=have is not None))

    present = {w.rank for w in current}
    missing = [rank for rank in range(size) if rank not in present]
    # Only the manifests this pass sends (_first_pod_writes keeps its budget): building all 1,024
    # of a new gang's, 11 passes in a row, was 0.3 s of each pass's CPU.
    budget = p.pod_write_budget - sum(isinstance(a, (CreatePod, DeletePod)) for a in p.actions)
    p.more = len(missing) > max(0, budget)
    for rank in missing[: max(0, budget)]:
        manifest = manifests.worker_pod(
            job, rank, size, generation, p.settings.workers, avoid_nodes=sorted(p.silent),
            restarts_left=job.max_restarts - int(p.status.get("restarts") or 0),
        )  # fmt: skip
        p.actions.append(CreatePod(manifest))

    running = [w for w in current if w.phase == "Running" and not w.deleting]
    if len(running) < size and p.status.get("phase") in {PENDING, RESTARTING}:
        unscheduled = sum(1 for w in current if not w.node_name)
        where = f" ({unscheduled} not scheduled yet)" if unscheduled else ""
        p.wait("Workers", f"waiting for {size - len(running)} of {size} workers of generation {generation} "
               f"to run{where}")  # fmt: skip
    if len(running) == size and p.status.get("phase") in {PENDING, RESTARTING}:
        restarting = p.condition(RESTARTING)
        if restarting and restarting.get("status") == "True" and restarting.get("reason") in FAILURE_REASONS:
            since = from_rfc3339(restarting.get("lastTransitionTime"))
            if since is not None:
                p.actions.append(ObserveRecovery((p.now - since).total_seconds()))
        p.set_phase(RUNNING, "Running", f"generation {generation}: all {size} workers running")


def _fit_beside_silent_nodes(p: _Pass, size: int) -> int:
    """A restarted generation is sized when its restart is decided, often before the lost rank's
    node is found silent: before its pods exist, it shrinks (never below minReplicas) to what fits
    beside the silent nodes, instead of leaving a pod unschedulable for unschedulableTimeoutSeconds
    (60 s by default) first."""
    fits = _capacity(p)
    target = max(p.job.min_replicas, min(size, fits))
    if target >= size:
        return size
    p.status["replicas"] = target
    p.status["worldSize"] = target * p.job.nproc_per_worker
    p.event(
        "Rescale",
        f"generation {p.status.get('generation')} starts with {target} workers, not {size}: {fits} fit "
        f"beside the silent nodes {', '.join(sorted(p.silent))}",
    )
    return target


def _read_gang(p: _Pass, current: Sequence[Worker]) -> None:
    """Volcano's view of the gang (its PodGroup's phase, and while it waits the scheduler's
    reason) as the job's GangScheduled condition; a Warning event each time the scheduler gives a
    new reason, a Normal one when the gang is placed."""
    group = p.obs.podgroup
    if not p.job.uses_podgroup or group is None or p.status.get("phase") in FINISHED:
        return  # a finished job keeps the view of its last run (Volcano calls it Completed next)
    placing = any(w.node_name and not w.deleting for w in current)
    seen = gang.view(group, p.obs.queue, p.obs.queue_missing, placing)
    p.poll = p.poll or not seen.scheduled  # the operator watches neither PodGroups nor queues
    before = p.condition(gang.CONDITION) or {}
    if seen.scheduled and before.get("status") != "True":
        p.event("GangScheduled", seen.message)
    elif seen.why is not None and before.get("message") != seen.message:
        p.event("GangWaiting", seen.message, warning=True)
    p.set_condition(gang.CONDITION, seen.scheduled, seen.phase, seen.message)


def _read_metrics(p: _Pass) -> None:
    """Step and last checkpoint from rank 0. Steps count from 1, so a gauge at 0 is a trainer
    still starting (before it loaded its checkpoint): it says nothing, and must not move the
    job's step back to 0 in between."""
    progress = p.obs.progress
    if progress is None:
        return
    if progress.step:
        if progress.step != p.status.get("step"):
            p.status["lastProgressTime"] = to_rfc3339(p.now)
        p.status["step"] = progress.step
    if progress.checkpoint_step and progress.checkpoint_time:
        moment = datetime.fromtimestamp(progress.checkpoint_time, UTC)
        p.status["lastCheckpoint"] = {"step": progress.checkpoint_step, "time": to_rfc3339(moment)}
    if progress.checkpoint_failures is not None:
        _track_checkpoint_writes(p, progress.checkpoint_failures)
    if progress.in_place_restarts is not None:
        _count_in_place(p, progress.in_place_restarts, progress.restart_cause)
    _recovered(p, accounting.sample(p.status, progress, p.now))


def _restarted(
    p: _Pass,
    reason: str,
    failed_at: datetime | None,
    exit_code: int | None,
    *,
    planned: bool,
    size_before: int,
) -> None:
    """A recovery begins: on status.recoveries, and in the job's metrics."""
    record, closed = accounting.restarted(
        p.status, reason=reason, now=p.now, failed_at=failed_at, exit_code=exit_code, planned=planned,
        size_before=size_before,
    )  # fmt: skip
    _recovered(p, closed)
    if record is not None:
        p.actions.append(JobRestarted(record["cause"], record["stepsRedone"]))


def _recovered(p: _Pass, record: Mapping[str, Any] | None) -> None:
    """A recovery ended (`record`, None: none did): its Event and its downtime in the metrics."""
    if record is None:
        return
    p.event("GangRecovered", recoveries.summary(record), warning=False)
    p.actions.append(JobRecovered(record["cause"], float(record["downtimeSeconds"])))


def _failed_at(p: _Pass, failures: Sequence[Failure]) -> datetime | None:
    """When the first of `failures` happened, where the pods or nodes say: a container's end, a
    node's NotReady, the last step of a stalled gang (None: not known)."""
    moments: list[datetime] = []
    for f in failures:
        w = f.worker
        if f.reason == "ProgressDeadlineExceeded":
            moments.append(from_rfc3339(p.status.get("lastProgressTime")) or p.now)
        elif f.reason == "NodeLost" and w.node_name in p.nodes:
            ready = _condition_time(p.nodes[str(w.node_name)].get("status") or {}, "Ready", None)
            moments += [ready] if ready is not None else []
        elif w.finished is not None:
            moments.append(w.finished)
    return min(moments, default=None)


def _count_in_place(p: _Pass, seen: int, cause: str | None, account: bool = True) -> None:
    """Restarts in place of the current generation (elastic.restartInPlace): those not counted yet
    go into status.restarts, with a Warning event. `seen` comes from rank 0's metrics, or from the
    last line of a failed pod's agent (which rank 0's metrics may not have shown yet). `account`:
    a recovery on the job's status; not for an agent's last line, whose gang failed for good after
    restarts whose cost nothing shows (a record would close at once, 0 s down)."""
    counted = int(p.status.get("inPlaceRestarts") or 0)
    if seen <= counted:
        return
    restarts = int(p.status.get("restarts") or 0) + seen - counted
    p.status["restarts"] = restarts
    p.status["inPlaceRestarts"] = seen
    for _ in range(seen - counted):
        p.actions.append(CountRestart("InPlace"))
    if account:
        size = int(p.status.get("replicas") or 0)
        _restarted(p, "InPlace", None, recoveries.exit_code_in(cause), planned=False, size_before=size)
    why = f": {cause}" if cause else ""
    p.event(
        "RestartedInPlace",
        f"generation {p.status.get('generation')}: the gang restarted in place ({seen} in this generation, "
        f"{restarts} restarts in all){why}",
        warning=True,
    )


def _track_checkpoint_writes(p: _Pass, failures: int) -> None:
    """Condition CheckpointWriteFailing: rank 0's periodic checkpoints refused by the volume in a
    row (the trainer trains on without them, so nothing else on the job would show it)."""
    failing = (p.condition(CHECKPOINT_WRITE_FAILING) or {}).get("status") == "True"
    if failures > 0:
        newest = (p.status.get("lastCheckpoint") or {}).get("step")
        resume = f"step {newest}" if newest else "the start"
        message = (
            f"rank 0 reports {failures} checkpoint writes in a row refused by the checkpoint volume "
            f"(full, read-only or failing; the workers' logs name the error): the gang trains on, "
            f"and a restart now would resume from {resume}"
        )
        if not failing:
            p.event("CheckpointWriteFailed", message, warning=True)
        p.set_condition(CHECKPOINT_WRITE_FAILING, True, "VolumeRefused", message)
    elif failing:
        newest = (p.status.get("lastCheckpoint") or {}).get("step")
        message = f"rank 0 reports no checkpoint write refused since its last one (newest: step {newest})"
        p.event("CheckpointWriteRecovered", message)
        p.set_condition(CHECKPOINT_WRITE_FAILING, False, "NoRefusedWrites", message)


def _running_gang(p: _Pass, current: Sequence[Worker], size: int) -> datetime | None:
    """Since when the current generation runs in full (phase Running); None when it does not."""
    running = [w for w in current if w.phase == "Running" and not w.deleting]
    if p.status.get("phase") != RUNNING or size == 0 or len(running) != size:
        return None
    return from_rfc3339((p.condition(RUNNING) or {}).get("lastTransitionTime"))


def _track_metrics(p: _Pass, current: Sequence[Worker], size: int) -> None:
    """Condition MetricsAvailable: what a running rank 0 publishes (see dtjob.operator.progress)."""
    since = _running_gang(p, current, size)
    if since is None:
        return
    known = p.condition(METRICS_AVAILABLE)
    running = (p.now - since).total_seconds()
    if (known or {}).get("status") != "True":  # no answer yet: NoMetrics once the grace ends
        p.wake_at(since + timedelta(seconds=p.settings.metrics_grace_seconds))
    seen = metrics_availability(
        p.obs.progress, known, running, p.settings.metrics_grace_seconds, p.job.metrics_port
    )
    if seen is not None:
        p.set_condition(METRICS_AVAILABLE, seen.value, seen.reason, seen.message)


def _stalled(p: _Pass, current: Sequence[Worker], size: int) -> Failure | None:
    """A running gang whose step has not advanced for progressDeadlineSeconds, as a failure."""
    deadline = p.job.progress_deadline_seconds
    since = _running_gang(p, current, size)
    if deadline is None or since is None or not publishes_step(p.condition(METRICS_AVAILABLE)):
        return None
    stalled = stalled_for(p.now, from_rfc3339(p.status.get("lastProgressTime")), since)
    if stalled is None:
        return None
    p.wake_at(p.now + timedelta(seconds=deadline - stalled), strict=True)
    if stalled <= deadline:
        return None
    rank0 = next((w for w in current if w.rank == 0), current[0])
    message = (
        f"step {p.status.get('step', 0)} has not advanced for {stalled:.0f}s "
        f"(elastic.progressDeadlineSeconds={deadline})"
    )
    return Failure(rank0, "ProgressDeadlineExceeded", message, True)


def _some(items: Sequence[str], joiner: str = ", ") -> str:
    """The first few items and how many more: a gang of 1,024 that fails at once is one line on
    the job (its event and condition), not 1,024."""
    if len(items) <= LISTED + 1:
        return joiner.join(items)
    return f"{joiner.join(items[:LISTED])}{joiner}and {len(items) - LISTED} more"


def _describe(p: _Pass, failures: Sequence[Failure]) -> str:
    """One message for the failures of a pass; the survivors of a lost peer are summed up under
    the rank they name, and beyond LISTED failures the rest are counted, not listed."""
    parts = [f.message for f in failures if f.reason != "PeerLost"]
    if len(parts) > LISTED + 1:
        parts = [_some(parts, "; ")]
    lost: dict[int | None, list[str]] = {}
    for f in failures:
        if f.reason == "PeerLost":
            lost.setdefault(f.lost_rank, []).append(f.worker.name)
    timeout = p.job.heartbeat_timeout_seconds
    for rank, names in lost.items():
        who = f"{_some(names)} exited {EXIT_PEER_LOST}"
        if rank is None:
            parts.append(f"{who}: a peer stopped answering (no rank named in the log)")
        else:
            name = manifests.worker_name(p.job.name, rank)
            parts.append(f"rank {rank} ({name}) lost: no heartbeat for {timeout}s ({who})")
    return "; ".join(parts)
