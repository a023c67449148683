"""Property tests of the pure reconciler (hypothesis).

Two parts. Random observations: whatever the job's status, its pods (any ranks, generations,
phases, exit codes, nodes, deletions) and the nodes, one pass never creates a pod beside pods of
another generation, never more pods than the world size, never starts a generation outside the
elastic bounds, always counts a restart caused by a failure, and never succeeds a job whose
current gang did not all exit 0.

Wake-ups: for the same random observations, nothing time alone can change comes before the
pass's `wake_at` (the next pass the operator schedules when no event comes): a pass at any
moment before it decides the same as the pass at `now`, the timestamps it writes aside.

Random event orders: a small simulated cluster (scheduler, kubelets, a trainer that checkpoints
every few steps, resumes from its newest checkpoint and exits 75 on a planned SIGTERM) runs the
real reconciler between random faults and user actions (worker kills, node loss and return,
kubectl scale, suspend and resume, time passing). At every moment at most one generation's pods
exist, no generation has more pods than its world size, every generation is sized inside the
bounds, restarts equal the failures that caused a new generation, and a job that Succeeded ran
exactly the steps it was asked for; once the faults stop, the job finishes.

DTJOB_PROPERTY_EXAMPLES sets the number of examples (default 60: about 10 s on 2 cores).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from datetime import datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from dtjob.operator.actions import (
    Action,
    CountRestart,
    CreatePod,
    DeleteJob,
    DeletePod,
    ObserveRecovery,
    PatchStatus,
)
from dtjob.operator.failures import FAILURE_REASONS
from dtjob.operator.observed import Observed
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.reconciler import plan, reconcile
from dtjob.operator.settings import ReconcilerSettings
from dtjob.operator.timefmt import to_rfc3339
from tests.unit.reconciler_fixtures import at, make_job, make_node, make_pod, status_patch

SETTINGS = ReconcilerSettings()
# Examples per run: 60 keeps both tests near 10 s here; DTJOB_PROPERTY_EXAMPLES=2000 for a soak.
EXAMPLES = int(os.environ.get("DTJOB_PROPERTY_EXAMPLES", "60"))
COUNTED = FAILURE_REASONS - {"WorkerStopped"}
MIN, MAX = 2, 5


def label(pod: dict[str, Any], key: str) -> int:
    return int(pod["metadata"]["labels"][f"training.dtjob.io/{key}"])


def world_size_of(pod: dict[str, Any]) -> int:
    trainer = pod["spec"]["containers"][0]
    return int(next(e["value"] for e in trainer.get("env") or [] if e["name"] == "WORLD_SIZE"))


# --- random observations ------------------------------------------------------------------------
@st.composite
def observations(draw: st.DrawFn) -> Observed:
    replicas = draw(st.integers(MIN, MAX))
    max_restarts = draw(st.integers(0, 3))
    elastic: dict[str, Any] = {"restartPolicy": draw(st.sampled_from(["ExitCode", "OnFailure", "Never"]))}
    if draw(st.booleans()):
        elastic["progressDeadlineSeconds"] = draw(st.integers(5, 120))
    run_policy: dict[str, Any] = {}
    if draw(st.booleans()):
        run_policy["activeDeadlineSeconds"] = draw(st.integers(1, 400))
    if draw(st.booleans()):
        run_policy["ttlSecondsAfterFinished"] = draw(st.integers(0, 300))
    status: dict[str, Any] | None = None
    generation = draw(st.integers(0, 3))
    if draw(st.integers(0, 4)) > 0:
        size = draw(st.integers(MIN, MAX))
        since = draw(st.floats(0, 200))
        status = {
            "phase": draw(st.sampled_from(["Pending", "Running", "Restarting", "Succeeded", "Failed"])),
            "generation": generation,
            "replicas": size,
            "restarts": draw(st.integers(0, max_restarts)),
            "startTime": to_rfc3339(at(0)),
            "step": draw(st.integers(0, 50)),
            "conditions": [
                {
                    "type": "Running",
                    "status": "True",
                    "reason": "Running",
                    "message": "",
                    "lastTransitionTime": to_rfc3339(at(since)),
                }
            ],
        }
        if draw(st.booleans()):
            status["lastCheckpoint"] = {"step": draw(st.integers(1, 50)), "time": to_rfc3339(at(since + 1))}
        if status["phase"] in {"Succeeded", "Failed"}:
            status["completionTime"] = to_rfc3339(at(draw(st.floats(0, 300))))
        if draw(st.booleans()):
            status["lastProgressTime"] = to_rfc3339(at(draw(st.floats(0, 300))))
    job = make_job(
        replicas=replicas,
        min_replicas=MIN,
        max_replicas=MAX,
        max_restarts=max_restarts,
        status=status,
        elastic=elastic,
        runPolicy=run_policy,
    )
    nodes = [
        make_node(f"n{i}", cpu="2", ready=draw(st.booleans())) for i in range(1, draw(st.integers(1, 3)) + 1)
    ]
    pods = []
    for rank in sorted(draw(st.sets(st.integers(0, MAX + 1), max_size=MAX + 2))):  # one pod per name
        phase = draw(st.sampled_from(["Pending", "Running", "Succeeded", "Failed"]))
        exit_code = {"Succeeded": 0, "Failed": draw(st.sampled_from([1, 2, 75, 76, 137]))}.get(phase)
        pod = make_pod(
            rank,
            generation=draw(st.integers(max(0, generation - 2), generation)),
            phase=phase,
            node=draw(st.sampled_from([None, "n1", "n2", "n3", "gone"])),
            exit_code=exit_code,
            deleting=draw(st.booleans()),
            created=draw(st.floats(0, 200)),
            grace_ends=draw(st.floats(0, 400)),
        )
        pods.append(pod)
    progress = draw(
        st.none()
        | st.builds(TrainerProgress, step=st.none() | st.integers(0, 60), checkpoints_published=st.booleans())
    )
    now = at(draw(st.floats(0, 400)))
    return Observed(job=job, pods=pods, nodes=nodes, now=now, node_pods=pods, progress=progress)


@settings(max_examples=4 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observations())
def test_one_pass_never_breaks_the_invariants(obs: Observed) -> None:
    actions = reconcile(obs, SETTINGS)
    before = dict(obs.job.get("status") or {})
    after = {**before, **status_patch(actions)}
    generation, size = after.get("generation"), int(after.get("replicas") or 0)
    made = [a for a in actions if isinstance(a, CreatePod)]
    if made:
        assert all(label(c.manifest, "generation") == generation for c in made)
        assert not [p for p in obs.pods if label(p, "generation") != generation], "two generations at once"
        ranks = [label(c.manifest, "rank") for c in made]
        present = {label(p, "rank") for p in obs.pods}
        assert len(set(ranks)) == len(ranks) and all(r < size for r in ranks) and not set(ranks) & present
        assert len(present) + len(ranks) <= size, "more pods than the world size"
    if after.get("generation") != before.get("generation") and after.get("phase") != "Suspended":
        assert MIN <= size <= MAX, f"generation {generation} sized {size}"
    restarts_before, restarts_after = int(before.get("restarts") or 0), int(after.get("restarts") or 0)
    assert restarts_after - restarts_before in (0, 1)
    counted = [a for a in actions if isinstance(a, CountRestart)]
    assert len(counted) <= 1 and (not counted or restarts_after == restarts_before + 1)
    restarting = next((c for c in after.get("conditions") or [] if c["type"] == "Restarting"), {})
    if after.get("generation") != before.get("generation") and restarting.get("reason") in COUNTED:
        assert restarts_after == restarts_before + 1, f"restart for {restarting['reason']} not counted"
    if _counted_failure(obs) and after.get("phase") != "Failed":
        assert restarts_after == restarts_before + 1, "a failed worker of the gang, no counted restart"
    if after.get("phase") == "Succeeded" and before.get("phase") != "Succeeded":
        current = [p for p in obs.pods if label(p, "generation") == generation and label(p, "rank") < size]
        assert len(current) == size and all(p["status"]["phase"] == "Succeeded" for p in current)
        # the final step is at least the final checkpoint's (the simulation below checks it is
        # exactly the steps asked for)
        assert int(after.get("step") or 0) >= int((after.get("lastCheckpoint") or {}).get("step") or 0)


def _decision(actions: list[Action], now: datetime) -> str:
    """The actions as text, without what only says when the pass ran: the timestamps it writes
    (now, to the second) and the recovery time it measures."""
    kept = [
        dataclasses.asdict(a) | {"kind": type(a).__name__}
        for a in actions
        if not isinstance(a, ObserveRecovery)
    ]
    return json.dumps(kept, sort_keys=True, default=str).replace(to_rfc3339(now), "<now>")


@settings(max_examples=4 * EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observations(), st.floats(0.0, 1.0, exclude_max=True))
def test_nothing_changes_before_the_wake(obs: Observed, fraction: float) -> None:
    # The timestamps a pass writes are its `now` to the second: one the job already holds could
    # not be told from a new one.
    assume(to_rfc3339(obs.now) not in json.dumps(obs.job) + json.dumps(obs.pods))
    first = plan(obs, SETTINGS)
    # No wake: time alone never changes the decision; any later moment must decide the same.
    horizon = 1000.0 if first.wake_at is None else (first.wake_at - obs.now).total_seconds()
    assert horizon > 0, f"a wake at {first.wake_at}, not after now {obs.now}"
    event("wakes" if first.wake_at is not None else "no wake")
    # Whole microseconds, rounded down: a datetime holds no less, and rounding up could reach the wake
    # (as the float product can: 268.831131 s x 0.9999999999999998 made 268831131 us, the wake).
    micros = min(int(horizon * fraction * 1e6), round(horizon * 1e6) - 1)
    later = dataclasses.replace(obs, now=obs.now + timedelta(microseconds=micros))
    assert _decision(plan(later, SETTINGS).actions, later.now) == _decision(first.actions, obs.now), (
        f"the decision changed {horizon * fraction:.3f}s after now, before the wake at {first.wake_at}"
    )


def _counted_failure(obs: Observed) -> bool:
    """A worker of the current gang failed (not exit 75) while the job runs normally."""
    status = obs.job.get("status") or {}
    if not status.get("phase") or status.get("phase") not in {"Pending", "Running", "Restarting"}:
        return False
    generation, size = status.get("generation"), int(status.get("replicas") or 0)
    for pod in obs.pods:
        if label(pod, "generation") != generation or label(pod, "rank") >= size:
            continue
        if (
            pod["status"]["phase"] == "Failed"
            and pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] != 75
        ):
            return True
    return False


# --- random event orders -----------------------------------------------------------------------------
STEPS, CHECKPOINT_EVERY = 24, 4


class Cluster(RuleBasedStateMachine):
    """One job on three 2-cpu nodes (1-cpu workers), faults and user actions in random order."""

    @initialize(replicas=st.integers(MIN, 4), dtjob_trainer=st.booleans())
    def start(self, replicas: int, dtjob_trainer: bool) -> None:
        self.job: dict[str, Any] | None = make_job(
            replicas=replicas, min_replicas=MIN, max_replicas=MAX, max_restarts=50
        )
        self.dtjob_trainer = dtjob_trainer  # False: a plain script that publishes no metrics
        self.pods: dict[str, dict[str, Any]] = {}
        self.nodes = {f"n{i}": True for i in (1, 2, 3)}
        self.t = 0.0
        self.checkpoint = 0  # newest checkpoint step on the shared volume
        self.step = 0  # the trainer's step in the running gang
        self.gang: int | None = None  # generation whose gang formed
        self.planned: set[str] = set()  # pods deleted with SIGTERM and their full grace
        self.sizes: dict[int, int] = {}  # world size of every generation the operator started
        # Failures of the current gang no restart answered yet: ("pod", name) or ("node", name); a
        # node back before the operator looked was no failure.
        self.unanswered: set[tuple[str, str]] = set()
        self.passes = 0

    # the operator -----------------------------------------------------------------------------
    def observe(self) -> Observed:
        assert self.job is not None
        nodes = [make_node(n, cpu="2", ready=ok) for n, ok in self.nodes.items()]
        pods = [copy.deepcopy(p) for p in self.pods.values()]
        return Observed(
            job=copy.deepcopy(self.job),
            pods=pods,
            nodes=nodes,
            now=at(self.t),
            node_pods=pods,
            progress=self.progress(),
        )

    def progress(self) -> TrainerProgress | None:
        status = (self.job or {}).get("status") or {}
        rank0 = self.pods.get("gpt-worker-0")
        if not self.dtjob_trainer or rank0 is None or label(rank0, "generation") != status.get("generation"):
            return None
        if rank0["status"]["phase"] == "Running" and self.gang == status.get("generation"):
            return TrainerProgress(self.step, self.checkpoint or None, at(self.t).timestamp(), True)
        if rank0["status"]["phase"] == "Succeeded":
            return TrainerProgress(self.step, self.checkpoint, at(self.t).timestamp(), True)
        return None

    @rule()
    def operator_pass(self) -> None:
        if self.job is None:
            return
        before = dict(self.job.get("status") or {})
        actions = reconcile(self.observe(), SETTINGS)
        self.apply(actions)
        self.passes += 1
        after = (self.job or {}).get("status") or {}
        if after.get("generation") != before.get("generation"):
            generation = int(after["generation"])
            if after.get("phase") != "Suspended":  # a job created suspended has no gang yet: size 0
                self.sizes[generation] = int(after["replicas"])
            restarting = next((c for c in after["conditions"] if c["type"] == "Restarting"), {})
            reason = restarting.get("reason") if after.get("phase") == "Restarting" else None
            counted = int(after.get("restarts") or 0) - int(before.get("restarts") or 0)
            if reason in COUNTED:
                assert counted == 1, f"a {reason} restart not counted"
            else:
                assert counted == 0, f"a {reason} restart counted"
            if self.unanswered and after.get("phase") == "Restarting":
                assert counted == 1, (
                    f"the failure {self.unanswered} that started generation {generation} was not counted"
                )
            self.unanswered.clear()
        if after.get("phase") == "Failed":
            self.unanswered.clear()

    def apply(self, actions: list[Action]) -> None:
        assert self.job is not None
        for action in actions:
            match action:
                case PatchStatus(status=patch):
                    self.job["status"] = {**(self.job.get("status") or {}), **copy.deepcopy(patch)}
                case CreatePod(manifest=manifest):
                    name = action.name
                    assert name not in self.pods, f"created {name} over an existing pod"
                    pod = copy.deepcopy(manifest)
                    pod["metadata"]["creationTimestamp"] = to_rfc3339(at(self.t))
                    pod["status"] = {"phase": "Pending"}
                    self.pods[name] = pod
                case DeletePod(name=name, grace_seconds=grace):
                    pod = self.pods.get(name)
                    if pod is None:
                        continue
                    if grace == 0:
                        del self.pods[name]
                    else:
                        pod["metadata"]["deletionTimestamp"] = to_rfc3339(at(self.t))
                        if grace is None:
                            self.planned.add(name)
                case DeleteJob():
                    self.job = None
                    self.pods.clear()

    # the cluster ------------------------------------------------------------------------------
    @rule(dt=st.floats(0.5, 40))
    def time_passes(self, dt: float) -> None:
        self.t += dt

    @rule()
    def scheduler_and_kubelets(self) -> None:
        """Bind pending pods where a cpu is free; start bound ones; finish deletions."""
        used = {n: 0 for n in self.nodes}
        for pod in self.pods.values():
            node = pod["spec"].get("nodeName")
            if node and pod["status"]["phase"] in {"Pending", "Running"}:
                used[node] += 1
        for name, pod in list(self.pods.items()):
            node = pod["spec"].get("nodeName")
            if "deletionTimestamp" in pod["metadata"]:
                if node is None or self.nodes[node]:  # a lost node's kubelet confirms nothing
                    self.stop(name, pod)
            elif node is None:
                free = [n for n, ok in self.nodes.items() if ok and used[n] < 2]
                if free:
                    pod["spec"]["nodeName"] = free[0]
                    used[free[0]] += 1
            elif self.nodes[node] and pod["status"]["phase"] == "Pending":
                pod["status"] = {"phase": "Running"}
        self.form_gang()

    def stop(self, name: str, pod: dict[str, Any]) -> None:
        """A deleted pod's trainer stops: after a planned SIGTERM in a formed gang it checkpoints
        its step and exits 75; the pod object then goes."""
        if (
            name in self.planned
            and self.gang == label(pod, "generation")
            and pod["status"]["phase"] == "Running"
        ):
            self.checkpoint = max(self.checkpoint, self.step) if self.step else self.checkpoint
        self.planned.discard(name)
        del self.pods[name]
        if self.gang == label(pod, "generation"):
            self.gang = None

    def gang_pods(self) -> list[dict[str, Any]]:
        status = (self.job or {}).get("status") or {}
        return [p for p in self.pods.values() if label(p, "generation") == status.get("generation")]

    def form_gang(self) -> None:
        members = self.gang_pods()
        running = [
            p
            for p in members
            if p["status"]["phase"] == "Running" and "deletionTimestamp" not in p["metadata"]
        ]
        if (
            members
            and len(running) == world_size_of(members[0])
            and self.gang != label(members[0], "generation")
        ):
            self.gang = label(members[0], "generation")
            self.step = self.checkpoint  # resume from the newest checkpoint, at any world size

    @rule(steps=st.integers(1, 5))
    def train(self, steps: int) -> None:
        members = self.gang_pods()
        if self.gang is None or not members or any(p["status"]["phase"] != "Running" for p in members):
            return
        if any("deletionTimestamp" in p["metadata"] for p in members):
            return
        for _ in range(steps):
            # A gang that resumed from the last step's checkpoint has nothing to do and exits 0
            # (a suspend that came after the last step, before the operator saw the gang end).
            if self.step < STEPS:
                self.step += 1
            if self.step % CHECKPOINT_EVERY == 0 or self.step == STEPS:
                self.checkpoint = self.step
            if self.step == STEPS:
                for pod in members:
                    pod["status"] = {
                        "phase": "Succeeded",
                        "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 0}}}],
                    }
                return

    @rule()
    def tick(self) -> None:
        """A quiet moment: the cluster and the operator catch up, the gang trains a little."""
        self.scheduler_and_kubelets()
        self.operator_pass()
        self.scheduler_and_kubelets()
        self.train(2)
        self.time_passes(2.0)

    # faults and users -------------------------------------------------------------------------------
    @rule(rank=st.integers(0, MAX - 1), code=st.sampled_from([1, 137, 76]))
    def kill_worker(self, rank: int, code: int) -> None:
        pod = self.pods.get(f"gpt-worker-{rank}")
        if (
            pod is None
            or pod["status"]["phase"] not in {"Pending", "Running"}
            or not pod["spec"].get("nodeName")
        ):
            return
        if self.in_current_gang(pod) and not self.spec_suspended():
            self.unanswered.add(("pod", f"gpt-worker-{rank}"))
        pod["status"] = {
            "phase": "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": code}}}],
        }
        if self.gang == label(pod, "generation"):
            self.gang = None

    @rule(node=st.sampled_from(["n1", "n2", "n3"]), ready=st.booleans())
    def node_changes(self, node: str, ready: bool) -> None:
        if not ready and self.nodes[node]:
            for pod in self.pods.values():
                if pod["spec"].get("nodeName") != node:
                    continue
                active = pod["status"]["phase"] in {"Pending", "Running"}
                if self.in_current_gang(pod) and active and not self.spec_suspended():
                    self.unanswered.add(("node", node))
                if self.gang == label(pod, "generation"):
                    self.gang = None
        if ready:
            self.unanswered.discard(("node", node))
        self.nodes[node] = ready

    def in_current_gang(self, pod: dict[str, Any]) -> bool:
        status = (self.job or {}).get("status") or {}
        return (
            label(pod, "generation") == status.get("generation")
            and label(pod, "rank") < int(status.get("replicas") or 0)
            and "deletionTimestamp" not in pod["metadata"]
        )

    @rule(replicas=st.integers(MIN, MAX))
    def kubectl_scale(self, replicas: int) -> None:
        if self.job is not None:
            self.job["spec"]["replicas"] = replicas

    @rule(suspend=st.booleans())
    def suspend_or_resume(self, suspend: bool) -> None:
        if self.job is not None:
            self.job["spec"]["runPolicy"] = {"suspend": suspend}
            if suspend:
                self.unanswered.clear()  # stopping the job answers a failure too

    def spec_suspended(self) -> bool:
        return bool(((self.job or {}).get("spec") or {}).get("runPolicy", {}).get("suspend"))

    # invariants ---------------------------------------------------------------------------------
    @invariant()
    def one_generation_at_a_time_and_never_too_many_pods(self) -> None:
        generations = {label(p, "generation") for p in self.pods.values()}
        assert len(generations) <= 1, f"pods of generations {sorted(generations)} at once"
        for g in generations:
            members = [p for p in self.pods.values() if label(p, "generation") == g]
            size = self.sizes.get(g, world_size_of(members[0]))
            assert len(members) <= size and all(label(p, "rank") < size for p in members)

    @invariant()
    def every_generation_inside_the_bounds(self) -> None:
        assert all(MIN <= size <= MAX for size in self.sizes.values()), self.sizes

    @invariant()
    def success_means_every_step_ran(self) -> None:
        status = (self.job or {}).get("status") or {}
        if status.get("phase") == "Succeeded":
            assert self.step == STEPS
            if self.dtjob_trainer:
                assert status.get("step") == STEPS

    def teardown(self) -> None:
        """With the faults over (nodes back, the job resumed), the job finishes."""
        if self.job is None or not self.passes:
            return
        for node in self.nodes:
            self.node_changes(node, True)
        self.job["spec"]["runPolicy"] = {"suspend": False}
        for _ in range(400):
            status = (self.job or {}).get("status") or {}
            if status.get("phase") in {"Succeeded", "Failed"}:
                break
            self.operator_pass()
            self.scheduler_and_kubelets()
            self.train(3)
            self.time_passes(3.0)
            self.one_generation_at_a_time_and_never_too_many_pods()
            self.success_means_every_step_ran()
        status = (self.job or {}).get("status") or {}
        event(
            f"restarts: {min(int(status.get('restarts') or 0), 3)}+, generations: {len(self.sizes) // 3 * 3}+"
        )
        assert status.get("phase") == "Succeeded", self.job


TestClusterEventOrders = Cluster.TestCase
TestClusterEventOrders.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
