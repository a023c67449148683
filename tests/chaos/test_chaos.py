"""Chaos on the devcluster: several jobs at once (DDP, ZeRO-3, pipeline, and a DDP job scaled down
and up with kubectl mid-run; the DDP job restarts in place, the others in new pods) while faults
of every kind in tests/chaos/faults.py hit them, one at a time, at seeded random moments. A
fault-free twin of each fixed-size job runs beside them. The control plane's faults (etcd, the API
server) must cost the job they come beside nothing: no restart, no new generation.

Each job's checkpoints go to a tmpfs of its own (the volume-full fault fills it). At the end every
job must have Succeeded with exactly its steps and its last checkpoint written, rank 0's step log
must show no damaged checkpoint loaded, every step run twice at one world size the same loss, the
final loss of each fixed-size job its twin's (1e-5 relative), and after the jobs are deleted no
pod, Service or trainer process of theirs may be left.

DTJOB_CHAOS_SEED (default 23) picks the moments, the ranks and the order; DTJOB_CHAOS_ROUNDS
(default 1) how many faults of each kind; DTJOB_CHAOS_KINDS (comma-separated, default every kind)
which kinds; DTJOB_CHAOS_RESULTS a JSON file for the counts (`make chaos`: 3 rounds into
bench/results/chaos.json). Times are recorded, never asserted.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.layout import Layout
from dtjob.operator.jobview import LABEL_GENERATION
from tests.chaos import faults
from tests.chaos.report import Outcome, markdown, summarize, write
from tests.e2e.conftest import Devcluster, kubectl, kubectl_json, wait_for
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    condition,
    events,
    job_manifest,
    open_gate,
    operator_namespace,
    pods,
    sigkill_worker,
    status,
    step_log,
    wait_phase,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED = int(os.environ.get("DTJOB_CHAOS_SEED", "23"))
ROUNDS = int(os.environ.get("DTJOB_CHAOS_ROUNDS", "1"))
RESULTS = os.environ.get("DTJOB_CHAOS_RESULTS")
KINDS = [k for k in os.environ.get("DTJOB_CHAOS_KINDS", ",".join(faults.KINDS)).split(",") if k]
CHECKPOINT_EVERY = 5
# A fault's wait for the gang to train again; past it the test fails naming the fault (a stuck job).
RECOVERY_TIMEOUT = 180.0
MODEL = ["--layers=2"]
HEARTBEAT_TIMEOUT = 4  # spec.elastic.heartbeatTimeoutSeconds: a hang or a cut is seen in ~4-5 s
STRATEGIES = {
    "ddp": ["--strategy=ddp"],
    "zero3": ["--strategy=fsdp", "--zero-stage=3"],
    "pipe": ["--strategy=pipeline", "--pipeline-stages=2", "--microbatches=4"],
}


@dataclass
class Job:
    name: str
    replicas: int
    args: list[str]
    scaled: bool = False  # kubectl scale to replicas - 1 and back, mid-run
    in_place: bool = False  # elastic.restartInPlace: a trainer's failure restarts it in its pods
    gate: int = 0
    plan: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("chaos")


@pytest.fixture
def volumes() -> Iterator[list[Path]]:
    """The checkpoint volumes (tmpfs) the test mounts: unmounted after it, before its namespace's
    directories are removed."""
    mounted: list[Path] = []
    yield mounted
    for root in mounted:
        faults.unmount_volume(root)


class ExitWatch:
    """`kubectl get pods --watch` in the background: when (this machine's clock, to the watch's
    latency) each worker's exit was first seen. The first exit after a fault is the gang's own
    detection: the killed worker itself, or the survivors of a hang or a cut leaving (exit 76)."""

    TEMPLATE = '{.metadata.name}{" "}{.status.containerStatuses[0].state.terminated.exitCode}{"\\n"}'

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.exits: list[tuple[float, str, int]] = []
        self._stopped = threading.Event()
        self._proc: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        kubectl_path = str(Binaries.pinned().path("kubectl"))
        while not self._stopped.is_set():  # a watch the API server ends is started again
            self._proc = subprocess.Popen(
                [
                    kubectl_path,
                    "get",
                    "pods",
                    "-n",
                    self.namespace,
                    "--watch",
                    "-o",
                    f"jsonpath={self.TEMPLATE}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                name, _, code = line.strip().partition(" ")
                if code.lstrip("-").isdigit():
                    self.exits.append((time.time(), name, int(code)))
            self._proc.wait()

    def first_exit(self, job: str, after: float) -> tuple[float, int] | None:
        """(seconds after `after`, exit code) of the job's first worker exit seen since then."""
        seen = [
            (t - after, code)
            for t, name, code in self.exits
            if t >= after and name.startswith(f"{job}-worker-")
        ]
        return min(seen) if seen else None

    def stop(self) -> None:
        self._stopped.set()
        if self._proc is not None:
            self._proc.kill()


def next_gate(rng: random.Random, after: int) -> int:
    """A step 4-9 past `after` that is no checkpoint step: at a gate no rank writes a checkpoint,
    so a checkpoint fault there damages a finished one."""
    gate = after + rng.randint(4, 9)
    return gate + 1 if gate % CHECKPOINT_EVERY == 0 else gate


def manifest(op: Operator, job: Job, steps: int, gate: int | None) -> dict[str, Any]:
    size = {"min_replicas": 1, "max_replicas": job.replicas} if job.scaled else {}
    m = job_manifest(
        op,
        job.name,
        replicas=job.replicas,
        steps=steps,
        checkpoint_every=CHECKPOINT_EVERY,
        gate=gate,
        trainer_args=MODEL + job.args,
        max_restarts=50,
        **size,
    )
    m["spec"]["elastic"]["heartbeatTimeoutSeconds"] = HEARTBEAT_TIMEOUT
    # One job restarts in place (the default of dtjob's trainer): its crashes, hangs and damaged
    # checkpoints are survived in its pods; the others take the path of a lost pod or node, new pods.
    m["spec"]["elastic"]["restartInPlace"] = job.in_place
    return m


def generation_of(log: list[dict[str, Any]]) -> int:
    return max((r["generation"] for r in log), default=0)


Gang = tuple[int, int]


def gang_of(record: dict[str, Any]) -> Gang:
    """Which gang logged a step: its generation (new pods) and its restarts in place."""
    return int(record["generation"]), int(record.get("in_place_restarts") or 0)


def newest_gang(log: list[dict[str, Any]]) -> Gang:
    return max((gang_of(r) for r in log), default=(0, 0))


def restarted(op: Operator, job: str, before: dict[str, Any]) -> bool:
    st = status(op, job)
    return int(st.get("restarts") or 0) > int(before.get("restarts") or 0) or int(
        st.get("generation") or 0
    ) > int(before.get("generation") or 0)


def wait_held(op: Operator, job: Job) -> None:
    """Until the job's newest gang waits at the job's gate (its last logged step, of the generation
    and the restarts in place the status names): an older gang may have passed the gate before a
    fault stopped it."""

    def held() -> bool:
        log = step_log(op, job.name)
        st = status(op, job.name)
        newest = (int(st.get("generation") or 0), int(st.get("inPlaceRestarts") or 0))
        return bool(log) and log[-1]["step"] >= job.gate and gang_of(log[-1]) == newest

    try:
        wait_for(f"{job.name}: its newest gang at step {job.gate}", held, timeout=RECOVERY_TIMEOUT)
    except pytest.fail.Exception as failed:
        pytest.fail(f"{failed}\n{where_is(op, job)}")


def where_is(op: Operator, job: Job) -> str:
    """What a stuck job looks like, for the failure message (the cluster's logs are gone by the
    time anyone reads it): its status, its pods and their tails, its last steps."""
    st = status(op, job.name)
    lines = [
        f"status: phase {st.get('phase')}, generation {st.get('generation')}, restarts {st.get('restarts')}, "
        f"waiting: {condition(st, 'Waiting').get('message')}"
    ]
    for p in pods(op, job.name):
        name, node = p["metadata"]["name"], p["spec"].get("nodeName")
        conditions = [
            f"{c['type']}={c['status']} {c.get('reason', '')}" for c in p["status"].get("conditions") or []
        ]
        lines.append(
            f"pod {name} gen {p['metadata']['labels'].get(LABEL_GENERATION)} on {node}: "
            f"{p['status'].get('phase')} {conditions}"
        )
        logs = kubectl("logs", "-n", op.namespace, name, "--tail=5", check=False)
        lines.extend(f"    {line}" for line in (logs.stdout or logs.stderr).strip().splitlines()[-5:])
    lines.append(f"last steps: {step_log(op, job.name)[-3:]}")
    for component in ("kube-scheduler", "kube-controller-manager"):  # their klog errors: E<date>
        log = Layout.from_env().log(component)
        text = log.read_text(errors="replace") if log.is_file() else ""
        errors = [line for line in text.splitlines() if line.startswith("E")]
        lines.extend(f"{component}: {line[:300]}" for line in errors[-3:])
    return "\n".join(lines)


def inject(op: Operator, job: Job, kind: str, rng: random.Random, watch: ExitWatch) -> Outcome:
    """Inject one fault into `job` (waiting at its gate), wait until it trains again, count."""
    wait_held(op, job)
    before_log = step_log(op, job.name)
    before_status = status(op, job.name)
    gang0 = newest_gang(before_log)
    rank = rng.randrange(int(before_status.get("replicas") or job.replicas))
    held_at = job.gate
    job.gate = next_gate(rng, job.gate)
    damaged: int | None = None
    node: str | None = None
    if kind in faults.CHECKPOINT_KINDS:
        damaged = faults.damage_checkpoint(faults.checkpoint_root(op, job.name), kind)
        t0 = sigkill_worker(op, job.name, rank)
        open_gate(op, job.name, job.gate)
    else:
        open_gate(op, job.name, job.gate)
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere in the steps the gate just let through
        if kind == "node":
            node = faults.node_of(op, job.name, rank)
        t0 = time.time()
        if kind in ("sigkill", "operator"):
            sigkill_worker(op, job.name, rank)
        elif kind == "sigstop":
            faults.sigstop_worker(op, job.name, rank)
        elif kind == "netcut":
            faults.pod_network(op, faults.pod_name(job.name, rank), up=False)
        elif kind == "node":
            assert node is not None
            faults.stop_node(node)
    detected: float | None = None
    again: float | None = None
    deadline = time.monotonic() + RECOVERY_TIMEOUT
    try:
        while again is None:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{job.name}: not training again {RECOVERY_TIMEOUT:.0f}s after {kind}\n"
                    f"{where_is(op, job)}"
                )
            if detected is None and restarted(op, job.name, before_status):
                detected = time.time() - t0
                if kind == "operator":  # mid-restart: the gang is being replaced right now
                    faults.restart_operator(op, down_seconds=rng.uniform(1.0, 3.0))
            log = step_log(op, job.name)
            if newest_gang(log) > gang0:
                again = time.time() - t0
            time.sleep(0.2)
    finally:
        if node is not None:
            faults.start_node(node)
    log = step_log(op, job.name)
    new = [r for r in log[len(before_log) :] if gang_of(r) > gang0]
    last_before = max(r["step"] for r in log[: len(log) - len(new)])
    resumed_from = new[0]["step"] - 1
    exited = watch.first_exit(job.name, t0)
    print(
        f"chaos: {kind} on {job.name} rank {rank} at gate {held_at}: first exit {exited}, "
        f"restart seen {detected}, training again {again:.1f}s, resumed from {resumed_from} "
        f"(damaged {damaged})"
    )
    return Outcome(
        kind,
        job.name,
        detected,
        again,
        max(0, last_before - resumed_from),
        resumed_from,
        damaged,
        exited=exited[0] if exited else None,
        exit_code=exited[1] if exited else None,
        from_memory=new[0].get("resumed_from") == "memory",
    )


def volume_full(op: Operator, job: Job, rng: random.Random) -> Outcome:
    """The job's checkpoint volume filled while its gang waits at the gate; the gate opens past a
    checkpoint step. The refused write costs no restart and no step: the gang trains on and the
    job shows it (condition CheckpointWriteFailing, event CheckpointWriteFailed); the volume is
    freed once it does. Times count from rank 0 logging the checkpoint step: "detected" is the
    condition on the job, "training again" the next step logged (what the refused write cost)."""
    wait_held(op, job)
    before_log, before_status = step_log(op, job.name), status(op, job.name)
    gang0, last = newest_gang(before_log), before_log[-1]["step"]
    refused = last + CHECKPOINT_EVERY - last % CHECKPOINT_EVERY
    filler = faults.fill_volume(faults.checkpoint_root(op, job.name))
    job.gate = next_gate(rng, job.gate + 1)  # 5 steps or more: one is a checkpoint step
    open_gate(op, job.name, job.gate)
    t0 = detected = again = None
    deadline = time.monotonic() + RECOVERY_TIMEOUT
    try:
        while detected is None or again is None:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{job.name}: its full volume not shown {RECOVERY_TIMEOUT:.0f}s on\n{where_is(op, job)}"
                )
            logged = max((r["step"] for r in step_log(op, job.name)), default=0)
            now = time.time()
            if t0 is None and logged >= refused:
                t0 = now
            if t0 is not None and again is None and logged > refused:
                again = now - t0
            failing = condition(status(op, job.name), "CheckpointWriteFailing").get("status") == "True"
            if t0 is not None and detected is None and failing:
                detected = now - t0
            time.sleep(0.1)
    finally:
        filler.unlink()
    assert "CheckpointWriteFailed" in [e["reason"] for e in events(op, job.name)]
    new = step_log(op, job.name)[len(before_log) :]
    assert all(gang_of(r) == gang0 for r in new), f"{job.name}: a full volume restarted the gang: {new}"
    assert not restarted(op, job.name, before_status), f"{job.name}: a full volume counted a restart"
    print(
        f"chaos: volume-full on {job.name}, checkpoint of step {refused} refused: shown on the job "
        f"{detected:.1f}s, next step {again:.1f}s"
    )
    return Outcome("volume-full", job.name, detected, again, 0, last, None)


def control_plane(op: Operator, job: Job, kind: str, rng: random.Random) -> Outcome:
    """etcd or the API server SIGKILLed just after the job's gate opens, started again 1-3 s
    later: no failure of the job. Its gang trains on to the next gate in the same generation (no
    restart, no step lost); "training again" is the first step rank 0 logs after the fault."""
    wait_held(op, job)
    before_log, before_status = step_log(op, job.name), status(op, job.name)
    gang0, last = newest_gang(before_log), before_log[-1]["step"]
    job.gate = next_gate(rng, job.gate)
    open_gate(op, job.name, job.gate)
    time.sleep(rng.uniform(0.0, 0.4))
    down = rng.uniform(1.0, 3.0)
    t0, seen = time.time(), len(step_log(op, job.name))
    # In the background: the steps while the component is down are what counts.
    with ThreadPoolExecutor(1) as pool:
        restart = pool.submit(faults.restart_component, faults.CONTROL_PLANE[kind], down)
        again = None
        deadline = time.monotonic() + RECOVERY_TIMEOUT
        while not restart.done() or step_log(op, job.name)[-1]["step"] < job.gate:
            if again is None and len(step_log(op, job.name)) > seen:
                again = time.time() - t0
            if time.monotonic() > deadline:
                pytest.fail(f"{job.name}: not at step {job.gate} {RECOVERY_TIMEOUT:.0f}s after {kind}")
            time.sleep(0.1)
        restart.result()  # its failure is the test's
    new = step_log(op, job.name)[len(before_log) :]
    assert all(gang_of(r) == gang0 for r in new), f"{job.name}: {kind} restarted the gang: {new}"
    assert not restarted(op, job.name, before_status), f"{job.name}: {kind} counted a restart"
    print(f"chaos: {kind} beside {job.name} at gate {last}: trained on, next step {again}")
    return Outcome(kind, job.name, None, again if again is not None else time.time() - t0, 0, last, None)


def rescale(op: Operator, job: Job, replicas: int, rng: random.Random) -> Outcome:
    """kubectl scale just after the job's gate opens, the operator SIGKILLed a moment later
    (mid-rescale) and started again; waits for the new size training. A planned rescale loses no
    step. A grow-back waits for a checkpoint newer than the gang's start, so the gate opens past
    one (6-11 steps always hold a multiple of 5)."""
    wait_held(op, job)
    before = step_log(op, job.name)
    gang0 = newest_gang(before)
    growing = replicas > int(status(op, job.name).get("replicas") or 0)
    job.gate = next_gate(rng, job.gate + 2)
    open_gate(op, job.name, job.gate)
    t0 = time.time()
    kubectl("scale", f"dtj/{job.name}", "-n", op.namespace, f"--replicas={replicas}", check=True)
    time.sleep(rng.uniform(0.0, 1.0))
    faults.restart_operator(op, down_seconds=rng.uniform(1.0, 3.0))

    def training() -> bool:
        return any(gang_of(r) > gang0 and r["world_size"] == replicas for r in step_log(op, job.name))

    # A stop that finds the gang waiting at its gate runs one more step (SIGTERM lets it past the
    # gate) and checkpoints it, so the next gang may resume past the gate and wait there without
    # a step to show: every 3 s without one, the gate moves a step on.
    deadline = time.monotonic() + RECOVERY_TIMEOUT
    nudged = time.monotonic()
    while not training():
        if time.monotonic() > deadline:
            pytest.fail(
                f"{job.name}: not training at {replicas} workers after {RECOVERY_TIMEOUT:.0f}s\n"
                f"{where_is(op, job)}"
            )
        if time.monotonic() - nudged > 3.0:
            # Never onto a checkpoint step: a gang held there has checkpointed it, and a gang
            # restarted then (another job's node stopped, say) resumes at the gate and logs no
            # step before it: `wait_held` would wait for a step that cannot come (found by the
            # suite: the node stop of pipe restarted scaled, held at 20).
            job.gate += 2 if (job.gate + 1) % CHECKPOINT_EVERY == 0 else 1
            open_gate(op, job.name, job.gate)
            nudged = time.monotonic()
        time.sleep(0.2)
    again = time.time() - t0
    log = step_log(op, job.name)
    new = [r for r in log[len(before) :] if gang_of(r) > gang0]
    last_before = max(r["step"] for r in log[: len(log) - len(new)])
    resumed_from = new[0]["step"] - 1
    kind = "scale-up" if growing else "scale-down"
    print(
        f"chaos: {kind} of {job.name} to {replicas}, operator killed: training again {again:.1f}s, "
        f"resumed from {resumed_from} (last step before {last_before})"
    )
    assert resumed_from == last_before, f"{job.name}: a planned {kind} lost steps"
    return Outcome(kind, job.name, None, again, 0, resumed_from)


def assert_sound(job: Job, log: list[dict[str, Any]], steps: int, outcomes: list[Outcome]) -> None:
    """Rank 0's step log of a finished job: every step up to `steps`, each gang's steps contiguous,
    no damaged checkpoint loaded, and the same loss whenever a step ran again at one world size."""
    assert {r["step"] for r in log} == set(range(1, steps + 1)), f"{job.name}: steps missing"
    assert log[-1]["step"] == steps
    by_gang: dict[Gang, list[int]] = {}
    for r in log:
        by_gang.setdefault(gang_of(r), []).append(r["step"])
    for gang, seen in by_gang.items():
        assert seen == list(range(seen[0], seen[-1] + 1)), f"{job.name} gang {gang}: {seen}"
    for o in outcomes:
        if o.damaged_step is not None and not o.from_memory:  # from memory: no checkpoint read
            assert o.resumed_from < o.damaged_step, f"{job.name} loaded the damaged checkpoint: {o}"
    losses: dict[tuple[int, int], list[float]] = {}
    for r in log:
        losses.setdefault((r["step"], r["world_size"]), []).append(float(r["loss"]))
    for (step, world), values in losses.items():
        assert max(values) - min(values) <= 1e-5 * abs(values[0]), (
            f"{job.name} step {step} at world size {world} ran to different losses: {values}"
        )


def assert_nothing_left(op: Operator) -> None:
    """After deleting every job: no pod, Service or trainer process of this namespace."""
    kubectl("delete", "dtj", "--all", "-n", op.namespace, "--wait=true", "--timeout=120s", check=True)

    def empty() -> bool:
        listed = kubectl_json("get", "pods,services", "-n", op.namespace)
        return not listed["items"]

    wait_for("no pod or Service left", empty, timeout=120)
    wait_for("no trainer process left", lambda: not namespace_processes(op.namespace), timeout=60)


def namespace_processes(namespace: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and f"DTJOB_NAMESPACE={namespace}".encode() in (proc / "environ").read_bytes()
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_jobs_under_chaos_succeed_with_every_step_and_their_twins_loss(
    op: Operator, volumes: list[Path]
) -> None:
    started = time.monotonic()
    rng = random.Random(SEED)
    jobs = [Job(name, 2, args, in_place=name == "ddp") for name, args in STRATEGIES.items()]
    jobs.append(Job("scaled", 3, STRATEGIES["ddp"], scaled=True))
    unknown = sorted(set(KINDS) - set(faults.KINDS))
    assert not unknown, f"DTJOB_CHAOS_KINDS: no fault kind {unknown}; the kinds: {', '.join(faults.KINDS)}"
    kinds = [k for k in KINDS for _ in range(ROUNDS)]
    rng.shuffle(kinds)
    for i, kind in enumerate(kinds):
        jobs[i % len(jobs)].plan.append(kind)
    scaled = jobs[-1]
    scaled.plan[len(scaled.plan) // 2 : len(scaled.plan) // 2] = ["scale-down"]
    scaled.plan.append("scale-up")
    steps = 20 + 10 * max(len(j.plan) for j in jobs)
    for j in jobs:
        if not j.scaled:
            apply(manifest(op, Job(f"{j.name}-twin", j.replicas, j.args), steps, gate=None))
        j.gate = next_gate(rng, 2)
        m = manifest(op, j, steps, gate=j.gate)  # makes the checkpoint directory
        faults.mount_volume(faults.checkpoint_root(op, j.name))
        volumes.append(faults.checkpoint_root(op, j.name))
        apply(m)
    # One fault at a time over all jobs, in a seeded order: each fault's times are its own.
    queue = [(j, kind) for j in jobs for kind in j.plan]
    order: list[tuple[Job, str]] = []
    while queue:
        heads = list(dict.fromkeys(j.name for j, _ in queue))
        name = rng.choice(heads)
        item = next(x for x in queue if x[0].name == name)
        queue.remove(item)
        order.append(item)
    outcomes: list[Outcome] = []
    watch = ExitWatch(op.namespace)
    try:
        for job, kind in order:
            if kind.startswith("scale-"):
                outcomes.append(
                    rescale(op, job, job.replicas - 1 if kind == "scale-down" else job.replicas, rng)
                )
            elif kind in faults.CONTROL_PLANE:
                outcomes.append(control_plane(op, job, kind, rng))
            elif kind == "volume-full":
                outcomes.append(volume_full(op, job, rng))
            else:
                outcomes.append(inject(op, job, kind, rng, watch))
    finally:
        watch.stop()
    for j in jobs:
        open_gate(op, j.name, steps)
    ends: dict[str, dict[str, Any]] = {}
    for j in jobs:
        done = wait_phase(op, j.name, "Succeeded", timeout=RECOVERY_TIMEOUT)
        log = step_log(op, j.name)
        ends[j.name] = {
            "phase": done["phase"],
            "step": done["step"],
            "restarts": done.get("restarts", 0),
            "generations": generation_of(log) + 1,
            "world_sizes": sorted({r["world_size"] for r in log}),
            "final_loss": log[-1]["loss"],
            "events": sorted({e["reason"] for e in events(op, j.name)}),
        }
        assert done["step"] == steps
        assert condition(done, "CheckpointWriteFailing").get("status") != "True", (
            f"{j.name}: its last checkpoint was refused: {done}"
        )
        unplanned = [
            o
            for o in outcomes
            if o.job == j.name and not o.kind.startswith("scale-") and o.kind not in faults.NO_RESTART
        ]
        assert int(done.get("restarts") or 0) >= len(unplanned), f"{j.name}: a restart not counted: {done}"
        assert_sound(j, log, steps, [o for o in outcomes if o.job == j.name])
    for j in jobs:
        if j.scaled:
            continue
        final = ends[j.name]["final_loss"]
        twin = wait_phase(op, f"{j.name}-twin", "Succeeded", timeout=RECOVERY_TIMEOUT)
        twin_log = step_log(op, f"{j.name}-twin")
        assert twin["step"] == steps and twin_log[-1]["step"] == steps
        ends[j.name]["twin_final_loss"] = twin_log[-1]["loss"]
        assert ends[j.name]["world_sizes"] == [j.replicas]
        assert abs(final - twin_log[-1]["loss"]) <= 1e-5 * abs(twin_log[-1]["loss"]), (
            f"{j.name}: final loss {final} != its fault-free twin's {twin_log[-1]['loss']}"
        )
    assert_nothing_left(op)
    print(markdown(summarize(outcomes)))
    meta = {"seed": SEED, "rounds": ROUNDS, "steps": steps, "seconds": round(time.monotonic() - started)}
    write(SCRATCH / "chaos.json", outcomes, ends, meta)
    if RESULTS:
        write(Path(RESULTS), outcomes, ends, meta)
