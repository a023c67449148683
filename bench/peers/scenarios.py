"""One repeat: one job carries every scenario in turn, each at a chosen step (the step gate holds
the gang after that step, so every fault hits a gang in the same state on both sides).

    submit                -> first step logged                         submit_to_first_step
    after step 12: SIGKILL worker-1's trainer process                 sigkill
    after step 27: SIGSTOP worker-1's trainer process (hung)          sigstop
    after step 42: stop worker-1's node (nodelet killed, pods die)    node_stop
    after step 52: scale to 1 (kubectl scale)                         scale_down
    after step 60: scale to 2                                         scale_up
    step 75: the job completes

Each fault's figure is the time from the fault to the first step a new gang logs ("training
again"), the steps logged twice (redone from the newest checkpoint, every 5 steps: faults come 2
steps after one) and the steps never logged. Scale figures wait for a step at the new world size;
until then the gate lets the gang do one step every METRONOME_S (the tiny model's steps take a
fraction of a second: a gang not stopped for the rescale would otherwise finish the job first,
and one held at a fixed step could not take the step a new gang resumes at).
Over the run: pods and Services created (a watch from before the submit), the operator's CPU
seconds and peak RSS from the submit to the job's end.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from bench.peers.jobs import BenchJob, StepLog
from bench.peers.kube import (
    BenchError,
    Created,
    devcluster,
    kubectl_json,
    machine_load,
    pod_pids,
    signal_all,
    trainer_pids,
    wait_for,
)
from bench.peers.operators import HostOperator

TOTAL_STEPS = 75
FAULT_STEPS = {"sigkill": 12, "sigstop": 27, "node_stop": 42, "scale_down": 52, "scale_up": 60}
SCENARIOS = tuple(FAULT_STEPS)
RECOVERY_TIMEOUT_S = 300.0
METRONOME_S = 3.0
FULL_WORLD_TIMEOUT_S = 150.0  # past it "back at 2 workers" counts as never (the row says how often)
FAULTED_POD = 1  # worker-1: not the pod whose Service is torchrun's rendezvous endpoint
# How long the gang holds at its gate before each fault, on both sides: a fault meets a job in its
# steady state, not one that started seconds ago. dtjob's standbys are ready about 10 s after their
# trainers start (5 s delay, 4 s of imports): 15 s puts the first fault after them (with a 1 s hold
# it came 8 s after the pods started and took the cold path; bench/README.md).
HOLD_BEFORE_FAULT_S = 15.0


def _step_records(log: StepLog, after: float) -> list[tuple[float, dict[str, Any]]]:
    return log.since(after)


def _first_after(
    log: StepLog, t0: float, world_size: int | None, timeout: float
) -> tuple[float, dict[str, Any]]:
    def seen() -> tuple[float, dict[str, Any]] | None:
        for at, r in _step_records(log, t0):
            if world_size is None or r.get("world_size") == world_size:
                return at, r
        return None

    what = "a step after the fault" + (f" at world size {world_size}" if world_size else "")
    found: tuple[float, dict[str, Any]] = wait_for(what, seen, timeout=timeout, interval=0.1)
    return found


def steps_accounting(records: list[tuple[float, dict[str, Any]]], t0: float, t1: float) -> dict[str, int]:
    """Steps redone and lost between a fault at t0 and the next one at t1, over every gang that
    formed in between (a peer may go on with 1 worker, then restart again to take the second one
    back): each time the logged step does not follow the one before, or the world size changes,
    a new gang resumed; it redid the steps from its first one up to the last one logged before it,
    or skipped those between them."""
    before = [r for at, r in records if at <= t0]
    window = [r for at, r in records if t0 < at <= t1]
    repeated = lost = 0
    if before:
        prev = before[-1]
        for r in window:
            step, last = int(r["step"]), int(prev["step"])
            if step != last + 1 or r.get("world_size") != prev.get("world_size"):
                repeated += max(0, last - step + 1)
                lost += max(0, step - last - 1)
            prev = r
    return {"repeated": repeated, "lost": lost}


class Metronome:
    """Moves the gate one step further every METRONOME_S, from fault_step + 1 up to `until`."""

    def __init__(self, job: BenchJob, fault_step: int, until: int) -> None:
        self.job, self.step, self.until = job, fault_step + 1, until
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(METRONOME_S) and self.step < self.until:
            self.step += 1
            self.job.gate(self.step)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def meet(
    last: dict[str, Any] | None, fault_step: int, world: int, running: int, limit: int
) -> tuple[str, int]:
    """What the bench does before a fault, from rank 0's last logged step and the pods running:
    ("ready", s) when `world` workers run and step s >= fault_step was logged at world size
    `world` (the gang is held at the gate after it); ("open", s + 1) when they run but the last
    step, past fault_step, was logged at another world size: the gang of `world` may wait at the
    gate without a step to log (it resumed from the checkpoint its predecessor wrote there, as a
    SIGTERM at the gate does one more step), or the old gang has not taken the new worker in yet;
    one more step lets either show, up to `limit` (the next fault's step); ("wait", 0) otherwise."""
    if last is None or running < world or int(last["step"]) < fault_step:
        return "wait", 0
    step = int(last["step"])
    if last.get("world_size") == world:
        return "ready", step
    return ("open", step + 1) if step + 1 < limit else ("wait", 0)


def _meet_gang(job: BenchJob, log: StepLog, fault_step: int, world: int, limit: int) -> int:
    """Waits for the gang a fault meets (see `meet`), opening the gate one step per METRONOME_S
    when it must; returns the step the gang is held after."""
    deadline = time.time() + RECOVERY_TIMEOUT_S
    opened = 0.0
    while time.time() < deadline:
        snap = log.snapshot()
        what, step = meet(snap[-1][1] if snap else None, fault_step, world, len(job.running_pods()), limit)
        if what == "ready":
            return step
        if what == "open" and time.time() - opened >= METRONOME_S:
            job.gate(step)
            opened = time.time()
        time.sleep(0.5)
    raise BenchError(
        f"timed out after {RECOVERY_TIMEOUT_S:g}s waiting for {world} workers held at step "
        f"{fault_step} or later"
    )


def run_repeat(
    job: BenchJob, operator: HostOperator, scenarios: tuple[str, ...] = SCENARIOS
) -> dict[str, Any]:
    """Runs one job through the chosen scenarios; returns its measurements (a failed wait ends the
    repeat early, recorded under "error", with what was measured until then)."""
    out: dict[str, Any] = {"operator": job.kind, "job": job.name, "load_start": machine_load(), "faults": {}}
    log = job.prepare()
    steps = [FAULT_STEPS[s] for s in scenarios]
    job.gate(steps[0] if steps else TOTAL_STEPS)
    pods_seen, services_seen = Created(job.namespace, "pods"), Created(job.namespace, "services")
    pods_seen.start()
    services_seen.start()
    assert operator.usage is not None
    cpu0 = operator.usage.cpu_seconds()
    operator.usage.start_sampling()
    log.start()
    stopped: list[int] = []
    try:
        t_submit = time.time()
        job.submit()
        first_at, _ = _first_after(log, t_submit, None, RECOVERY_TIMEOUT_S)
        out["submit_to_first_step_s"] = round(first_at - t_submit, 2)
        for i, scenario in enumerate(scenarios):
            fault_step = FAULT_STEPS[scenario]
            next_gate = steps[i + 1] if i + 1 < len(steps) else TOTAL_STEPS
            out["faults"][scenario] = result = _run_fault(job, log, scenario, fault_step, next_gate, stopped)
            print(f"    {job.kind} {scenario}: {result}", flush=True)
        job.gate(TOTAL_STEPS)
        out["outcome"] = wait_for("the job's end", job.outcome, timeout=RECOVERY_TIMEOUT_S, interval=1.0)
    except BenchError as e:
        out["error"] = str(e)
        print(f"    {job.kind}: {e}", flush=True)
    finally:
        t_end = time.time()
        out["operator_cpu_s"] = round(operator.usage.cpu_seconds() - cpu0, 2)
        out["operator_peak_rss_mib"] = round(operator.usage.stop_sampling() / 2**20, 1)
        out["run_s"] = round(t_end - t_submit, 1)
        signal_all(stopped, signal.SIGCONT)
        log.stop()
        records = [r for _, r in log.snapshot()]
        logged = [int(r["step"]) for r in records]
        out["steps_logged"] = len(logged)
        out["steps_missing"] = sorted(set(range(1, max(logged, default=0) + 1)) - set(logged))
        out["world_sizes"] = sorted({int(r.get("world_size", 0)) for r in records})
        faults = list(out["faults"].values())
        for i, fault in enumerate(faults):
            t1 = faults[i + 1]["t0"] if i + 1 < len(faults) else t_end
            fault.update(steps_accounting(log.snapshot(), fault["t0"], t1))
        out["load_end"] = machine_load()
        job.delete()
        out["pods_created"] = pods_seen.stop()
        out["services_created"] = services_seen.stop()
        for pod in (job.pod(0), job.pod(1)):
            signal_all(pod_pids(job.namespace, pod, b"dtjob.trainer"), signal.SIGKILL)  # any left behind
    return out


def _run_fault(
    job: BenchJob, log: StepLog, scenario: str, fault_step: int, next_gate: int, stopped: list[int]
) -> dict[str, Any]:
    world = REPLICAS_FOR[scenario]
    # The gang this fault meets: at the fault's step (or a little later) and at its world size.
    # Pods running are not enough: a PyTorchJob that went on with 1 worker after a node loss
    # takes the new second pod in only at torchrun's next restart.
    fault_step = _meet_gang(job, log, fault_step, world, next_gate)
    time.sleep(HOLD_BEFORE_FAULT_S)  # every rank past the step and waiting at the gate
    pod = job.pod(FAULTED_POD)
    node: str | None = None
    world_after: int | None = None
    if scenario in ("sigkill", "sigstop"):
        pids = wait_for(f"trainer process of {pod}", lambda: trainer_pids(job.namespace, pod), timeout=60)
        sig = signal.SIGKILL if scenario == "sigkill" else signal.SIGSTOP
        t0 = time.time()
        signal_all(pids, sig)
        if sig == signal.SIGSTOP:
            stopped.extend(pids)
    elif scenario == "node_stop":
        node = str(kubectl_json("get", "pod", pod, "-n", job.namespace)["spec"]["nodeName"])
        t0 = time.time()
        devcluster("node", "stop", node)
    elif scenario == "scale_down":
        t0 = time.time()
        job.scale(1)
        world_after = 1
    else:
        t0 = time.time()
        job.scale(2)
        world_after = 2
    # A fault's new gang trains on at once; a rescale's trains one step per METRONOME_S until a
    # step at the new world size shows (a PyTorchJob's torchrun takes a new node in only at its
    # next rendezvous, and would otherwise finish the job first).
    metronome = None if world_after is None else Metronome(job, fault_step, next_gate)
    job.gate(next_gate if metronome is None else fault_step + 1)
    if metronome is not None:
        metronome.start()
    result: dict[str, Any] = {"fault_step": fault_step, "t0": t0}
    try:
        at, first = _first_after(log, t0, None, RECOVERY_TIMEOUT_S)
        result["training_again_s"] = round(at - t0, 2)
        result["first_world_size"] = int(first.get("world_size", 0))
        if world_after is not None and result["first_world_size"] != world_after:
            at_w, _ = _first_after(log, t0, world_after, RECOVERY_TIMEOUT_S)
            result["at_new_world_size_s"] = round(at_w - t0, 2)
        elif world_after is not None:
            result["at_new_world_size_s"] = result["training_again_s"]
        if metronome is not None:
            metronome.stop()
        job.gate(next_gate)
        if scenario in ("sigkill", "sigstop", "node_stop"):
            # How long until the gang is back at 2 workers (a peer may first go on with 1). Not
            # fatal: a PyTorchJob's pod on a stopped node stays Terminating (nobody confirms its
            # end) and the operator makes no new one while the node is down.
            try:
                at2, _ = _first_after(log, t0, 2, FULL_WORLD_TIMEOUT_S)
                result["full_world_again_s"] = round(at2 - t0, 2)
            except BenchError as e:
                result["full_world_again_error"] = str(e)
    finally:
        if metronome is not None:
            metronome.stop()
        job.gate(next_gate)
        if node is not None:
            devcluster("node", "start", node)
    return result


# The gang size each scenario starts from.
REPLICAS_FOR: dict[str, int] = {"sigkill": 2, "sigstop": 2, "node_stop": 2, "scale_down": 2, "scale_up": 1}
