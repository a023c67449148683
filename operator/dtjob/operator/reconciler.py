"""The pure reconciler: observed job, pods and nodes in; the actions that converge them out.

No I/O happens here. `reconcile(Observed(...), settings)` looks at the job's status (its memory:
phase, generation, world size, restarts, what the trainer publishes), at the worker pods carrying
its job-name label, and at the nodes, and returns the actions of `dtjob.operator.actions`. It is
level-triggered: whatever happened before (an operator killed half-way, missed events), the same
observation gives the same decision, and applying it twice does no harm (pod names are fixed per
rank, so a second create is an AlreadyExists, never a duplicate).

The rules, in the order they are checked, each with the functions that hold its details:

1. A finished job (Succeeded/Failed) only cleans up pods (cleanPodPolicy) and is deleted after
   ttlSecondsAfterFinished. [lifecycle.clean_up_finished]
2. A new job starts generation 0 at the desired world size (or Suspended when spec says so);
   not while another live job of its namespace owns its checkpoint directory (an older one, or
   one that started first): it waits, with no pods, Waiting CheckpointDirInUse and a Warning
   event naming that job, until the owner finishes or is gone. [lifecycle.start, _hold_for,
   ownership.owner_before]
3. activeDeadlineSeconds past startTime fails the job. [lifecycle.deadline_passed]
4. suspend deletes the pods gracefully (the trainer checkpoints and exits 75); resuming starts a
   new generation, not counted as a restart. [lifecycle.suspend, restarts.new_generation]
5. Pods of an older generation are deleted; the new generation's pods are created only after the
   old ones are gone (they share names, and the old rank 0 owns MASTER_ADDR until it exits). A
   deletion that a Ready node's kubelet leaves unfinished 5 s past its grace period (2 s for a
   rank its peers declared lost that rule 6 could not force; a node gone silent, not NotReady
   yet) is forced, and new
   workers avoid that node (status.silentNodes) until it turns NotReady or renews its Lease.
   [_converge_pods, nodes.delete, nodes.silent_nodes]
6. In the current generation: a permanent exit code fails the job; all workers exiting 0 succeeds
   it; a failed, deleted or node-lost worker, survivors exiting 76 (a lost peer, named from their
   logs), or a step that did not advance for progressDeadlineSeconds start a new generation
   (restarts += 1, the job fails once restarts would exceed maxRestarts) sized to what fits now,
   never below minReplicas; a worker that exited 75 on its own (stopped with a checkpoint) or that
   the scheduler preempted restarts the gang uncounted, and its peers get their full grace period
   to checkpoint. A rank the survivors name as lost (no heartbeat) is force-deleted in that same
   pass and its node avoided by new workers (status.silentNodes, trusted again at its next Lease
   renewal, its NotReady, or after 120 s), so the next gang is created at once, not 3 s later; only
   where the other nodes have no room for the whole next gang does the lost rank get a 1 s grace
   (rule 5 then finds a silent node out, and its NodeSilent event says why). Restarts the pods'
   agents made in place (elastic.restartInPlace; rank 0's metrics, or a failed pod's agent's last
   line) count in restarts as well. [_decide, failures.detect, failures.stalled_gang,
   suspects.suspect_nodes, nodes.delete_all, restarts.new_generation, restarts.count_in_place]
7. Pods unschedulable past the elastic scheduling timeout shrink the job to what fits (planned);
   a Volcano gang whose members would fit waits instead (its queue or priority holds it).
   [rescale.maybe_shrink]
8. A healthy gang whose world size differs from the desired one rescales (planned): down at
   once on `kubectl scale`, up when the capacity is there, after the generation's first
   checkpoint when the trainer reports checkpoints (condition MetricsAvailable).
   [rescale.maybe_rescale]

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

This file keeps the rules and their order; the details live in a module per concern beside it:
lifecycle.py (start, deadline, success and failure, clean-up, suspend), nodes.py (lost nodes,
silent kubelets, deleting workers), suspects.py (the node of a rank its peers lost), failures.py
(what failed in the current generation), restarts.py (a new generation, restarts in place,
recoveries), rescale.py (capacity, shrink and rescale), trainer_reports.py (what rank 0
reports), observed.py (the input) and reconcile_pass.py (the status, actions and phase one pass
builds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from dtjob import contract
from dtjob.api import validate_job
from dtjob.operator import (
    failures,
    gang,
    in_place,
    lifecycle,
    manifests,
    nodes,
    ownership,
    rescale,
    restarts,
    suspects,
    trainer_reports,
)
from dtjob.operator.actions import (
    Action,
    ApplyPodGroup,
    CreatePod,
    CreateService,
    DeletePod,
    ObserveRecovery,
    PatchStatus,
)
from dtjob.operator.jobview import JobView
from dtjob.operator.observed import Observed, Worker
from dtjob.operator.reconcile_pass import FINISHED, PENDING, RESTARTING, RUNNING, SUSPENDED, ReconcilePass
from dtjob.operator.settings import ReconcilerSettings
from dtjob.operator.timefmt import from_rfc3339, to_rfc3339

WAITING = "Waiting"


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


def reconcile(obs: Observed, settings: ReconcilerSettings) -> list[Action]:
    """Decide what to do about one job. Pure: same observation and settings, same actions."""
    return plan(obs, settings).actions


def plan(obs: Observed, settings: ReconcilerSettings) -> Plan:
    """`reconcile`'s actions, and when the job needs its next pass if nothing happens."""
    job = JobView(obs.job)
    if job.deleting:
        return Plan([])  # garbage collection removes the children through their owner references
    p = ReconcilePass(obs, settings, job, _copy_status(job.status))
    workers = [obs.worker_cache.of(pod) for pod in obs.pods]

    if p.status.get("phase") in FINISHED:
        # The clean-up policy is part of the spec: a spec the model rejects leaves the pods alone.
        if not job.spec_errors:
            lifecycle.clean_up_finished(p, workers)
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
    if p.condition(in_place.CONDITION) is not None:  # set by lifecycle.start: follows the spec from then on
        lifecycle.say_in_place(p)

    owner = None if p.status.get("phase") else ownership.owner_before(obs.job, obs.checkpoint_claims)
    if owner is not None:  # rule 2: nothing is created, not even the Service
        _hold_for(p, owner)
        return _finish(p)
    nodes.silent_nodes(p)
    if not obs.service_exists:
        p.actions.append(CreateService(manifests.headless_service(job)))
    if not p.status.get("phase"):
        lifecycle.start(p)
    p.status["selector"] = job.selector

    if job.suspend:
        lifecycle.suspend(p, workers)
        return _finish(p)
    if p.status.get("phase") == SUSPENDED:
        restarts.new_generation(
            p, rescale.target_size(p), "Resumed", "resumed after suspend", counted=False, phase=PENDING
        )
        p.status["startTime"] = to_rfc3339(p.now)  # the deadline counts from the resume, as for Jobs

    if lifecycle.deadline_passed(p):
        message = f"the job ran longer than activeDeadlineSeconds={job.active_deadline_seconds}"
        lifecycle.fail(p, workers, "DeadlineExceeded", message)
        for w in workers:  # past its deadline nothing of the job may keep running, whatever the policy
            if not w.terminal:
                nodes.delete(p, w, message)
        return _finish(p)

    generation = int(p.status.get("generation", 0))
    size = int(p.status.get("replicas") or 0)
    current = [w for w in workers if w.generation == generation and w.rank is not None and w.rank < size]
    trainer_reports.read_metrics(p)
    trainer_reports.track_metrics(p, current, size)
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


def _hold_for(p: ReconcilePass, owner: ownership.Claim) -> None:
    """Rule 2's hold: wait for the owner of the checkpoint directory; a Warning event when the
    message is new. The owner finishing triggers this job (dtjob.operator.cache); its last pods
    stopping do not, so the job is looked at again every tick."""
    message = ownership.held_message(p.obs.job, owner)
    if (p.condition(WAITING) or {}).get("message") != message:
        p.event(ownership.REASON, message, warning=True)
    p.wait(ownership.REASON, message)
    p.poll = True


def _decide(p: ReconcilePass, current: Sequence[Worker], workers: Sequence[Worker]) -> bool:
    """Rules 6-8 on the current generation. Returns True when the pass is done (a new
    generation was started, or the job finished)."""
    job = p.job
    size = int(p.status.get("replicas") or 0)
    found = failures.detect(p, current)

    if not found:
        stall = failures.stalled_gang(p, current, size)
        found = [stall] if stall is not None else []

    for f in found:
        code = f.worker.exit_code
        if f.reason not in {"WorkerFailed", "PeerLost"}:
            continue
        if job.restart_policy == "Never":
            lifecycle.fail(p, workers, "RestartPolicyNever", f"{f.message}; elastic.restartPolicy is Never")
            return True
        if code is not None and job.is_permanent_exit_code(code):
            lifecycle.fail(
                p,
                workers,
                "PermanentError",
                f"{f.message}; exit code {code} is permanent (permanentExitCodes)",
            )
            return True

    succeeded = [w for w in current if w.phase == "Succeeded"]
    if not found and size > 0 and len(succeeded) == size and len(current) == size:
        lifecycle.succeed(p, current)
        return True

    if found:
        counted = any(f.counted for f in found)
        message = failures.describe(p, found)
        agents_said = [contract.parse_in_place_line(p.obs.worker_logs.get(f.worker.name, "")) for f in found]
        restarts.count_in_place(
            p, max((n for n in agents_said if n is not None), default=0), None, account=False
        )
        restarts_so_far = int(p.status.get("restarts") or 0)
        if counted and restarts_so_far + 1 > job.max_restarts:
            p.status["restarts"] = restarts_so_far + 1
            limit = f"restart {restarts_so_far + 1} would exceed maxRestarts={job.max_restarts}"
            lifecycle.fail(p, workers, "MaxRestartsExceeded", f"{message}; {limit}")
            return True
        # The cause, not its echo: survivors exit PeerLost because of another failure; a preemption
        # names an uncounted restart.
        causes = [f for f in found if f.counted and f.reason != "PeerLost"] or found
        preempted = next((f.reason for f in found if f.reason == "Preempted"), causes[0].reason)
        reason = next((f.reason for f in causes if f.counted), preempted)
        cause = next(f for f in found if f.reason == reason)
        lost = failures.lost_pods(p, found, current)
        # Before the new generation is sized: it avoids the suspects (and fits beside them).
        suspected = suspects.suspect_nodes(p, lost)
        restarts.new_generation(
            p,
            rescale.target_size(p),
            reason,
            message,
            counted=counted,
            failed_at=failures.failed_at(p, found),
            exit_code=cause.worker.exit_code,
        )
        # A planned stop (preemption, a worker's own exit 75): the others checkpoint first, with
        # their full grace period; after a failure they cannot (a peer is gone).
        grace = p.settings.unplanned_stop_grace_seconds if counted else None
        nodes.delete_all(p, workers, grace, lost={w.name for w in lost}, suspects=suspected)
        return True

    if p.status.get("phase") == RESTARTING and any(
        w.generation != p.status.get("generation") for w in workers
    ):
        return False  # still removing the old generation

    unscheduled = [w for w in current if w.phase == "Pending" and not w.node_name and not w.deleting]
    if unscheduled and len(current) == size:
        return rescale.maybe_shrink(p, unscheduled, workers, size)

    running = [w for w in current if w.phase == "Running" and not w.deleting]
    if size > 0 and len(running) == size:
        return rescale.maybe_rescale(p, workers, size)
    return False


def _converge_pods(p: ReconcilePass, workers: Sequence[Worker], current: Sequence[Worker]) -> None:
    """Delete pods of old generations; once they are gone, create the current one's missing pods
    and mark the job Running when every worker runs."""
    job = p.job
    generation = int(p.status.get("generation", 0))
    size = int(p.status.get("replicas") or 0)
    old = [w for w in workers if w.generation != generation or w.rank is None or w.rank >= size]
    for w in old:
        nodes.delete(p, w, f"generation {w.generation} replaced by generation {generation}")
    if old:
        generations = ", ".join(sorted({str(w.generation) for w in old}))
        p.wait(
            "OldWorkers",
            f"waiting for {len(old)} workers of generation {generations} to exit before starting "
            f"generation {generation} (they share its pod names)",
        )
        return
    if not current and p.silent and p.status.get("phase") == RESTARTING:
        size = rescale.fit_beside_silent_nodes(p, size)

    if job.uses_podgroup:
        # Before the generation's pods: Volcano must see their minMember before it sees them.
        wanted = manifests.podgroup(job, size)
        have = p.obs.podgroup
        if have is None or gang.spec_differs(have, wanted):
            p.actions.append(ApplyPodGroup(wanted, exists=have is not None))

    present = {w.rank for w in current}
    missing = [rank for rank in range(size) if rank not in present]
    # Only the manifests this pass sends (_first_pod_writes keeps its budget): building all 1,024
    # of a new gang's is 0.3 s of CPU in each of the 11 passes that create it.
    budget = p.pod_write_budget - sum(isinstance(a, (CreatePod, DeletePod)) for a in p.actions)
    p.more = len(missing) > max(0, budget)
    for rank in missing[: max(0, budget)]:
        manifest = manifests.worker_pod(
            job,
            rank,
            size,
            generation,
            p.settings.workers,
            avoid_nodes=sorted(p.silent),
            restarts_left=job.max_restarts - int(p.status.get("restarts") or 0),
        )
        p.actions.append(CreatePod(manifest))

    running = [w for w in current if w.phase == "Running" and not w.deleting]
    if len(running) < size and p.status.get("phase") in {PENDING, RESTARTING}:
        unscheduled = sum(1 for w in current if not w.node_name)
        where = f" ({unscheduled} not scheduled yet)" if unscheduled else ""
        p.wait(
            "Workers",
            f"waiting for {size - len(running)} of {size} workers of generation {generation} to run{where}",
        )
    if len(running) == size and p.status.get("phase") in {PENDING, RESTARTING}:
        restarting = p.condition(RESTARTING)
        if (
            restarting
            and restarting.get("status") == "True"
            and restarting.get("reason") in failures.FAILURE_REASONS
        ):
            since = from_rfc3339(restarting.get("lastTransitionTime"))
            if since is not None:
                p.actions.append(ObserveRecovery((p.now - since).total_seconds()))
        p.set_phase(RUNNING, "Running", f"generation {generation}: all {size} workers running")


def _read_gang(p: ReconcilePass, current: Sequence[Worker]) -> None:
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


def _copy_status(status: Mapping[str, Any]) -> dict[str, Any]:
    copied = {k: v for k, v in status.items()}
    copied["conditions"] = [dict(c) for c in status.get("conditions") or []]
    return copied


def _finish(p: ReconcilePass) -> Plan:
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
