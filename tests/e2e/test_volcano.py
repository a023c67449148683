"""dtjob jobs under the real Volcano scheduler (`dtjob devcluster up --volcano`): gang scheduling,
queues with capability limits, priority preemption as a planned stop, elastic node loss with the
PodGroup following, the helm chart's Volcano value, and examples/volcano-queued.yaml as written.

The devcluster has 3 nodes with 2 GPUs and 4 cpus each. vc-scheduler runs the release's
volcano-scheduler-ci.conf without its enqueue action (allocate, backfill, reclaim, preempt; see
dtjob.devcluster.volcano). Every test prints the
timeline of its jobs' PodGroups and pods (and writes it beside the operator's log).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import Devcluster, dtjob_devcluster, helm, kubectl, kubectl_json, wait_for
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    condition,
    events,
    job_manifest,
    operator_namespace,
    pods,
    status,
    step_log,
    wait_phase,
    wait_status,
    wait_step,
)
from tests.e2e.test_operator_elastic import generations
from tests.e2e.volcano_harness import (
    HIGH,
    LOW,
    Timeline,
    apply_objects,
    bound,
    finished_at,
    node_action,
    node_ready,
    podgroup,
    priority_classes,
    queue,
    scheduled_at,
    volcano_up,
    wait_queue_open,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "volcano-queued.yaml"
SLEEPER = ["python", "-c", "import time; time.sleep(3600)"]
# A gang's members are bound in one scheduling session (vc-scheduler's period is 1 s); a watch
# sees the bindings one by one, milliseconds apart. Part of a gang bound for longer is a gang
# that was not placed whole.
PARTIAL_GANG_SECONDS = 3.0


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    volcano_up()
    apply_objects(*priority_classes())
    yield from operator_namespace("volcano")


def gang_job(op: Operator, name: str, replicas: int, gpus: int = 0, **kw: Any) -> dict[str, Any]:
    """A tiny job (operator_harness.job_manifest) scheduled by Volcano as one gang."""
    scheduling = {"gang": True, **kw.pop("scheduling", {})}
    manifest = job_manifest(op, name, replicas, scheduling=scheduling, **kw)
    if gpus:
        resources = manifest["spec"]["template"]["spec"]["containers"][0]["resources"]
        resources["requests"]["nvidia.com/gpu"] = gpus
        resources["limits"] = {"nvidia.com/gpu": gpus}
        # the devcluster's GPUs are only capacity: one CPU trainer process per pod, not one per GPU
        manifest["spec"]["nprocPerWorker"] = 1
    return manifest


def blocker(op: Operator, name: str, gpus: int) -> dict[str, Any]:
    """A plain pod (the default scheduler) that holds `gpus` GPUs."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": op.namespace},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "hold",
                    "image": "busybox",
                    "command": SLEEPER,
                    "resources": {"requests": {"nvidia.com/gpu": gpus}, "limits": {"nvidia.com/gpu": gpus}},
                }
            ],
        },
    }


def holds_for(what: str, predicate: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), f"{what} stopped holding"
        time.sleep(1.0)


def kubectl_pod(op: Operator, name: str) -> dict[str, Any]:
    return dict(kubectl_json("get", "pod", name, "-n", op.namespace))


def generations_of(op: Operator, name: str) -> set[str]:
    return {p["metadata"]["labels"]["training.dtjob.io/generation"] for p in pods(op, name)}


def gang_condition(op: Operator, name: str) -> dict[str, Any]:
    return condition(status(op, name), "GangScheduled")


def test_gang_of_four_waits_whole_on_gpus_for_three_and_starts_together(op: Operator) -> None:
    node = "dtjob-node-3"
    node_action("stop", node)
    try:
        wait_for(f"{node} NotReady", lambda: not node_ready(node), timeout=90)
        # 4 GPUs on the two Ready nodes, one of them held: GPUs for 3 workers
        apply_objects(blocker(op, "hold-1-gpu", 1))
        wait_for("the blocker to run", lambda: bool(bound([kubectl_pod(op, "hold-1-gpu")])), timeout=60)
        manifest = gang_job(op, "gang4", replicas=4, min_replicas=4, max_replicas=4, gpus=1, steps=20)
        with Timeline(op, "gang4") as timeline:
            apply(manifest)
            wait_for("4 pods", lambda: len(pods(op, "gang4")) == 4, timeout=90)
            wait_for(
                "the job to say why it waits",
                lambda: "tasks in gang unschedulable" in gang_condition(op, "gang4").get("message", ""),
                timeout=90,
            )
            holds_for("no worker bound (not 3 of 4)", lambda: not bound(pods(op, "gang4")), 20)
            waiting = status(op, "gang4")
            assert waiting["phase"] == "Pending"
            shown = condition(waiting, "GangScheduled")
            assert shown["status"] == "False" and shown["reason"] in {"Pending", "Inqueue"}
            warnings = [e for e in events(op, "gang4") if e["reason"] == "GangWaiting"]
            assert warnings and warnings[0]["type"] == "Warning"
            print(f"\nwhile waiting: {shown['message']}")
            node_action("start", node)
            wait_phase(op, "gang4", "Running", timeout=120)
            times = sorted({scheduled_at(p) for p in pods(op, "gang4")} - {None})
            wait_phase(op, "gang4", "Succeeded", timeout=180)
        done = status(op, "gang4")
        assert done["restarts"] == 0 and done["generation"] == 0, "one gang, started once"
        assert max(timeline.bound_counts("0")) == 4
        assert timeline.longest_partial_gang("0", 4) <= PARTIAL_GANG_SECONDS, "3 of 4 bound"
        assert condition(status(op, "gang4"), "GangScheduled")["status"] == "True"
        print(f"bind times of the 4 workers: {times}")
        said = [(e["type"], e["reason"], e["message"]) for e in events(op, "gang4") if "Gang" in e["reason"]]
        print(f"gang events on the job: {said}")
        assert [r["step"] for r in step_log(op, "gang4")] == list(range(1, 21))
    finally:
        node_action("start", node)
        kubectl("delete", "pod", "hold-1-gpu", "-n", op.namespace, "--wait=false")


def test_full_queue_holds_its_job_while_the_other_queue_runs(op: Operator) -> None:
    # capability for one 2-worker job of 500m each
    apply_objects(queue("vq-a", {"cpu": "1", "memory": "1Gi"}), queue("vq-b", {"cpu": "1", "memory": "1Gi"}))
    for name in ("vq-a", "vq-b"):
        wait_queue_open(name)
    try:
        first = gang_job(op, "qa1", replicas=2, steps=60, scheduling={"queue": "vq-a"})
        # elastic: a shrink would not help it into the full queue, so the operator must not try
        second = gang_job(op, "qa2", replicas=2, min_replicas=1, steps=20, scheduling={"queue": "vq-a"})
        other = gang_job(op, "qb1", replicas=2, steps=20, scheduling={"queue": "vq-b"})
        with Timeline(op, "qa2") as timeline:
            apply(first)
            wait_phase(op, "qa1", "Running", timeout=120)
            apply(second)
            apply(other)
            wait_phase(op, "qb1", "Running", timeout=120)
            assert not bound(pods(op, "qa2")), "qa2 got nodes while its queue was full"
            assert status(op, "qa2")["phase"] == "Pending" and status(op, "qa1")["phase"] == "Running"
            group = podgroup(op, "qa2")
            assert group is not None and group["status"].get("phase") in {"Pending", "Inqueue"}
            wait_for(
                "qa2 to say its queue is full",
                lambda: "Volcano queue vq-a is full" in gang_condition(op, "qa2").get("message", ""),
                timeout=30,
            )
            print(f"\nqa2 while vq-a is full: {gang_condition(op, 'qa2')['message']}")
            wait_phase(op, "qa1", "Succeeded", timeout=240)
            done = wait_phase(op, "qa2", "Succeeded", timeout=240)
            wait_phase(op, "qb1", "Succeeded", timeout=240)
        assert done["generation"] == 0 and done["replicas"] == 2, "qa2 ran whole, not shrunk"
        assert timeline.longest_partial_gang("0", 2) <= PARTIAL_GANG_SECONDS, "qa2 started as one gang"
        started = min(r for r in (scheduled_at(p) for p in pods(op, "qa2")) if r)
        assert started >= finished_at(pods(op, "qa1")), "qa2 bound only once qa1's workers ended"
    finally:
        for name in ("qa1", "qa2", "qb1"):
            kubectl("delete", "dtj", name, "-n", op.namespace, "--wait=true", "--timeout=60s")
        kubectl("delete", "queues.scheduling.volcano.sh", "vq-a", "vq-b", "--wait=false")


def test_high_priority_job_preempts_a_low_one_which_resumes_from_its_checkpoint(op: Operator) -> None:
    steps = 150
    # one 2-GPU worker per node: the low job holds all 6 GPUs
    low = gang_job(
        op,
        "low",
        replicas=3,
        min_replicas=3,
        max_replicas=3,
        gpus=2,
        steps=steps,
        checkpoint_every=5,
        scheduling={"priorityClassName": LOW},
    )
    high = gang_job(op, "high", replicas=1, gpus=1, steps=30, scheduling={"priorityClassName": HIGH})
    checkpoints = SCRATCH / op.namespace / "low" / "checkpoints"
    with Timeline(op, "low") as timeline:
        apply(low)
        wait_phase(op, "low", "Running", timeout=120)
        wait_step(op, "low", 10)
        apply(high)
        restarting = wait_status(op, "low", "preempted", lambda s: s.get("generation", 0) >= 1, timeout=120)
        assert condition(restarting, "Restarting")["reason"] == "Preempted"
        assert restarting["restarts"] == 0, "a preemption is not a failure"
        wait_phase(op, "high", "Running", timeout=120)
        wait_for("generation 0 gone", lambda: "0" not in generations_of(op, "low"), timeout=120)
        # the gang waits whole while the high job runs: its PodGroup holds it
        assert not bound(pods(op, "low")) and status(op, "low")["phase"] == "Restarting"
        stopped_at = max(r["step"] for r in step_log(op, "low"))
        newest = max(int(d.name.split("-")[1]) for d in checkpoints.glob("step-*"))
        assert newest == stopped_at, (
            f"the gang checkpointed the step it stopped after ({stopped_at}): {newest}"
        )
        wait_phase(op, "high", "Succeeded", timeout=240)
        done = wait_phase(op, "low", "Succeeded", timeout=400)
    assert done["restarts"] == 0 and done["generation"] == 1 and done["step"] == steps
    log = step_log(op, "low")
    assert [r["step"] for r in log] == list(range(1, steps + 1)), "every step exactly once"
    gens = generations(log)
    assert [(g, w) for g, w, _, _ in gens] == [(0, 3), (1, 3)] and gens[1][2] == stopped_at + 1
    states = timeline.pod_states("0")
    preempted = [name for name, seen in states.items() if any(p["preempted"] for p in seen)]
    assert len(preempted) == 1, states
    exits = {name: [p["exit"] for p in seen if p["exit"] is not None] for name, seen in states.items()}
    assert all(codes and codes[-1] == 75 for codes in exits.values()), f"every rank exits 75: {exits}"
    reasons = [e["reason"] for e in events(op, "low")]
    assert "Preempted" in reasons and "WorkerFailed" not in reasons
    print(f"\nlow: {preempted[0]} preempted; stopped after step {stopped_at}, resumed at {gens[1][2]}")


def running_again(s: dict[str, Any]) -> bool:
    return s.get("replicas") == 3 and s.get("phase") == "Running" and s.get("generation", 0) >= 2


def test_node_loss_shrinks_the_gang_and_its_podgroup_then_grows_back(op: Operator) -> None:
    steps = 200
    # 3 cpus per worker on 4-cpu nodes: one worker per node
    manifest = gang_job(
        op, "elastic", replicas=3, min_replicas=2, max_replicas=3, cpu="3", steps=steps, checkpoint_every=4
    )
    with Timeline(op, "elastic") as timeline:
        apply(manifest)
        wait_phase(op, "elastic", "Running", timeout=120)
        wait_step(op, "elastic", 8)
        lost = next(
            p["spec"]["nodeName"] for p in pods(op, "elastic") if p["metadata"]["name"].endswith("-1")
        )
        node_action("stop", lost)
        try:
            small = wait_status(
                op,
                "elastic",
                "2 running",
                lambda s: s.get("replicas") == 2 and s.get("phase") == "Running",
                timeout=180,
            )
            group = podgroup(op, "elastic")
            assert group is not None and group["spec"]["minMember"] == 2
            assert small["generation"] >= 1
            at_two = lambda: sum(r["world_size"] == 2 for r in step_log(op, "elastic"))  # noqa: E731
            wait_for("3 steps at 2 workers", lambda: at_two() >= 3, timeout=120)
        finally:
            node_action("start", lost)
        wait_status(op, "elastic", "3 running again", running_again, timeout=180)
        done = wait_phase(op, "elastic", "Succeeded", timeout=300)
    assert done["step"] == steps
    members = [m for m in timeline.seen("minMember") if m is not None]
    assert members == [3, 2, 3], members
    sizes = [w for _, w, _, _ in generations(step_log(op, "elastic"))]
    assert min(sizes) == 2 and sizes[-1] == 3


def test_volcano_queued_example_runs_as_written(op: Operator) -> None:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    name = manifest["metadata"]["name"]
    # a fresh run: an earlier run's checkpoints would make it resume
    shutil.rmtree(manifest["spec"]["checkpoint"]["volume"]["hostPath"]["path"], ignore_errors=True)
    kubectl("apply", "-n", op.namespace, "-f", str(EXAMPLE), check=True)
    try:
        with Timeline(op, name) as timeline:
            wait_phase(op, name, "Running", timeout=180)
            wait_for("a trained step", lambda: (status(op, name).get("step") or 0) >= 2, timeout=300)
        group = podgroup(op, name)
        assert group is not None and group["status"]["phase"] == "Running"
        assert group["spec"]["minMember"] == 4 and group["spec"]["queue"] == "default"
        assert group["spec"]["minResources"]["nvidia.com/gpu"] == "4"
        assert timeline.longest_partial_gang("0", 4) <= PARTIAL_GANG_SECONDS, "all 4 bound together"
    finally:
        kubectl("delete", "dtj", name, "-n", op.namespace, "--wait=true", "--timeout=90s")


def test_up_volcano_runs_its_components_under_their_own_least_privilege_users(op: Operator) -> None:
    shown = dtjob_devcluster("status", timeout=60)
    assert shown.returncode == 0, shown.stdout
    for component in ("vc-controller-manager", "vc-scheduler"):
        row = next(line for line in shown.stdout.splitlines() if line.startswith(component))
        assert row.split()[-2:] == ["yes", "yes"], row
    again = dtjob_devcluster("up", "--volcano", timeout=120)
    assert again.returncode == 0 and "nothing changed" in again.stdout, again.stdout + again.stderr
    scheduler, controllers = "dtjob:volcano-scheduler", "dtjob:volcano-controller-manager"
    may = {
        (scheduler, "create", "pods --subresource=binding"): "yes",
        (scheduler, "delete", "pods"): "yes",
        (scheduler, "update", "podgroups.scheduling.volcano.sh"): "yes",
        (scheduler, "create", "pods"): "no",
        (scheduler, "get", "secrets"): "no",
        (scheduler, "update", "nodes"): "no",
        (controllers, "update", "queues.scheduling.volcano.sh"): "yes",
        (controllers, "create", "pods"): "no",
        (controllers, "create", "services"): "no",
    }
    for (user, verb, resource), answer in may.items():
        got = kubectl("auth", "can-i", verb, *resource.split(), "-A", f"--as={user}").stdout.strip()
        assert got == answer, f"{user} {verb} {resource}: {got}"
    state = kubectl("get", "queues.scheduling.volcano.sh", "default", "-o", "jsonpath={.status.state}")
    assert state.stdout == "Open"


HELM_RELEASE = "dtjob-volcano"  # contains the chart's name: the chart names its objects after it
HELM_NS = "dtjob-volcano-system"


def test_helm_chart_with_volcano_enabled_runs_queued_jobs_to_succeeded(op: Operator) -> None:
    """The chart's operator (its pod, ServiceAccount and RBAC with volcano.enabled=true) runs two
    jobs through a queue with room for one: the second waits, then both succeed, and the
    operator could read the PodGroups it made (the jobs' GangScheduled condition)."""
    jobs_ns = f"{op.namespace}-helm"
    chart_op = Operator(jobs_ns, SCRATCH / f"{jobs_ns}-chart-operator.log")
    chart_op.log.touch()
    kubectl("create", "namespace", jobs_ns, check=True)
    apply_objects(queue("vq-helm", {"cpu": "1", "memory": "1Gi"}))
    wait_queue_open("vq-helm")
    try:
        helm(
            "install",
            HELM_RELEASE,
            str(REPO / "helm" / "dtjob"),
            "--namespace",
            HELM_NS,
            "--create-namespace",
            "--wait",
            "--timeout",
            "180s",
            "--set",
            "volcano.enabled=true",
            "--set",
            f"watchNamespaces={{{jobs_ns}}}",
            check=True,
            timeout=300,
        )
        for name in ("first", "second"):
            apply(gang_job(chart_op, name, replicas=2, steps=20, scheduling={"queue": "vq-helm"}))
        first = wait_phase(chart_op, "first", "Succeeded", timeout=300)
        second = wait_phase(chart_op, "second", "Succeeded", timeout=300)
        starts = {
            n: min(filter(None, (scheduled_at(p) for p in pods(chart_op, n)))) for n in ("first", "second")
        }
        ends = {n: finished_at(pods(chart_op, n)) for n in ("first", "second")}
        print(f"\nhelm + volcano: bound at {starts}, done at {ends}")
        later, earlier = sorted(starts, key=lambda n: starts[n], reverse=True)
        assert starts[later] >= ends[earlier], f"both ran at once in a queue for one: {starts} {ends}"
        said = {
            n: [(e["reason"], e["message"]) for e in events(chart_op, n) if "Gang" in e["reason"]]
            for n in starts
        }
        print(f"gang conditions: {[condition(d, 'GangScheduled') for d in (first, second)]}; events: {said}")
        # what the chart's RBAC lets the operator read: the PodGroups and the queue
        assert any("Volcano queue vq-helm is full" in m for _, m in said[later]), said[later]
        for done in (first, second):
            assert done["step"] == 20 and "Volcano PodGroup" in condition(done, "GangScheduled")["message"]
    finally:
        kubectl("delete", "dtj", "--all", "-n", jobs_ns, "--wait=true", "--timeout=60s")
        helm("uninstall", HELM_RELEASE, "--namespace", HELM_NS, "--wait", timeout=300)
        kubectl("delete", "namespace", jobs_ns, HELM_NS, "--wait=false")
        kubectl("delete", "queues.scheduling.volcano.sh", "vq-helm", "--wait=false")
