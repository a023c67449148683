"""The operator at scale on KWOK's simulated nodes, scaled down to fit `make test`: one job of 128
workers on 64 simulated nodes, and 50 jobs of 4 workers submitted at once. What is checked is
behaviour, never time: every pod is created once per generation, every failure restarts exactly
its own gang (a new generation, all of it Running), every status says so, and the job's Events
are a handful, not one per pod. bench/scale.py measures the same scenarios at full size.

Network safety: every simulated pod's IP must be inside the devcluster's pod network and routed
to its bridge, where no host answers, so the operator's scrapes of rank 0 never leave this
machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from dtjob.devcluster import kwok
from dtjob.devcluster.scale_harness import (
    Admin,
    PodWatch,
    created_once,
    fail_worker,
    outside_pod_network,
    simulated_job,
)
from tests.e2e.conftest import Devcluster, dtjob_devcluster, kubectl, kubectl_json, wait_for
from tests.e2e.operator_harness import Operator, apply, operator_namespace, status

pytestmark = pytest.mark.e2e
FAKE_NODES = 64
GPUS_PER_NODE = 8
WORKERS = 128
JOBS = 50
# The first `up --fake-nodes` on a machine builds KWOK (about 7 minutes on 2 busy cores).
KWOK_UP_TIMEOUT = 1800.0
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def simulated_nodes(devcluster: Devcluster) -> Iterator[Admin]:
    up = dtjob_devcluster("up", "--fake-nodes", str(FAKE_NODES), timeout=KWOK_UP_TIMEOUT)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield Admin(devcluster.layout)
    finally:
        down = dtjob_devcluster("up", "--fake-nodes", "0")
        assert down.returncode == 0, down.stdout + down.stderr


@pytest.fixture(scope="module")
def op(simulated_nodes: Admin) -> Iterator[Operator]:
    yield from operator_namespace("scale")


def job_events(namespace: str, name: str) -> list[dict[str, Any]]:
    listed = kubectl_json("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}")
    return list(listed["items"])


def test_simulated_nodes_are_ready_tainted_and_listed_by_status(simulated_nodes: Admin) -> None:
    nodes = kubectl_json("get", "nodes", "-l", "type=kwok")["items"]
    assert len(nodes) == FAKE_NODES
    for node in nodes:
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", node["metadata"]["name"]
        assert kwok.TAINT in node["spec"]["taints"]
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(GPUS_PER_NODE)
    shown = dtjob_devcluster("status", timeout=60)
    assert shown.returncode == 0, shown.stdout
    assert f"{FAKE_NODES} of {FAKE_NODES} Ready" in shown.stdout


def test_simulated_pod_ips_stay_inside_the_devcluster_pod_network(simulated_nodes: Admin) -> None:
    """A pod on a simulated node gets an IP of KWOK's --cidr: it must be inside the pod network
    and routed to the devcluster's bridge (never a default route out of this machine)."""
    names = [f"ip-probe-{i}" for i in range(4)]
    for name in names:
        spec = {
            "containers": [{"name": "c", "image": "none", "command": ["sleep", "1"]}],
            "tolerations": [kwok.TOLERATION],
            "nodeSelector": dict(kwok.NODE_SELECTOR),
        }
        meta = {"name": name, "namespace": "default"}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
        simulated_nodes.request("POST", "/api/v1/namespaces/default/pods", pod)
    try:

        def ips() -> list[str]:
            pods = [kubectl_json("get", "pod", n, "-n", "default") for n in names]
            return [p["status"].get("podIP", "") for p in pods if p["status"].get("phase") == "Running"]

        wait_for("the probe pods to run", lambda: len([ip for ip in ips() if ip]) == len(names), timeout=60)
        assert outside_pod_network(ips()) == []
    finally:
        kubectl("delete", "pod", *names, "-n", "default", "--wait=false")


def test_a_128_worker_gang_is_created_once_and_restarted_whole(op: Operator, simulated_nodes: Admin) -> None:
    watch = PodWatch(simulated_nodes, op.namespace)
    watch.start()
    try:
        apply(simulated_job(op.namespace, "big", WORKERS, gpus=1))
        wait_for(
            "generation 0 all Running", lambda: watch.all_running("big", 0, WORKERS) is not None, TIMEOUT
        )
        wait_for("phase Running", lambda: status(op, "big").get("phase") == "Running", TIMEOUT)
        first = status(op, "big")
        assert (first["replicas"], first["readyReplicas"], first["generation"], first["restarts"]) == (
            WORKERS,
            WORKERS,
            0,
            0,
        )
        gen0 = watch.records("big", 0)
        assert len(gen0) == WORKERS and created_once(gen0) == {}
        assert {r.rank for r in gen0} == set(range(WORKERS))
        assert outside_pod_network(r.pod_ip for r in gen0 if r.pod_ip) == []

        fail_worker(simulated_nodes, op.namespace, "big-worker-37")
        wait_for(
            "generation 1 all Running", lambda: watch.all_running("big", 1, WORKERS) is not None, TIMEOUT
        )
        wait_for(
            "phase Running again",
            lambda: (s := status(op, "big")).get("phase") == "Running" and s.get("generation") == 1,
            TIMEOUT,
        )
        after = status(op, "big")
        assert (after["replicas"], after["readyReplicas"], after["restarts"]) == (WORKERS, WORKERS, 1)
        wait_for(
            "every generation-0 pod gone", lambda: all(r.deleted for r in watch.records("big", 0)), TIMEOUT
        )
        gen1 = watch.records("big", 1)
        assert len(gen1) == WORKERS and created_once(gen1) == {}, "each pod of generation 1 once"
        assert len(watch.records("big")) == 2 * WORKERS, "no pod of a third generation"
        restarting = [e for e in job_events(op.namespace, "big") if e["reason"] == "WorkerFailed"]
        assert len(restarting) == 1 and "big-worker-37 failed (exit code 1)" in restarting[0]["message"]
        # One event per transition: Created, Running, the restart, Running again; never one per pod.
        assert len(job_events(op.namespace, "big")) <= 6
        assert watch.error is None
    finally:
        watch.stop()
        kubectl("delete", "dtj", "big", "-n", op.namespace, "--wait=true", "--timeout=120s")


def test_50_jobs_run_and_5_of_them_recover_from_a_lost_worker(op: Operator, simulated_nodes: Admin) -> None:
    watch = PodWatch(simulated_nodes, op.namespace)
    watch.start()
    names = [f"many-{i:02d}" for i in range(JOBS)]
    try:
        manifest = "\n---\n".join(_yaml(simulated_job(op.namespace, n, 4, cpu="1")) for n in names)
        kubectl("apply", "-f", "-", input=manifest, check=True)

        def all_running(generation: int, jobs: list[str]) -> bool:
            return all(watch.all_running(n, generation, 4) is not None for n in jobs)

        wait_for(f"{JOBS} jobs' workers Running", lambda: all_running(0, names), TIMEOUT)
        wait_for(f"{JOBS} jobs Running", lambda: _phases(op) == {"Running": JOBS}, TIMEOUT)
        # Only these jobs' pods: the namespace may still hold the last test's, being deleted.
        ours = [r for n in names for r in watch.records(n)]
        assert created_once(ours) == {} and len(ours) == 4 * JOBS

        lose = names[::10]  # 5 jobs
        for n in lose:
            fail_worker(simulated_nodes, op.namespace, f"{n}-worker-2")
        wait_for("the 5 gangs restarted and Running", lambda: all_running(1, lose), TIMEOUT)

        def recovered() -> bool:
            jobs = {j["metadata"]["name"]: j.get("status") or {} for j in _jobs(op)}
            return all(jobs[n].get("phase") == "Running" and jobs[n].get("generation") == 1 for n in lose)

        wait_for("the 5 jobs Running at generation 1", recovered, TIMEOUT)
        time.sleep(3)  # a timer tick: nothing else may move
        jobs = {j["metadata"]["name"]: j.get("status") or {} for j in _jobs(op)}
        for n in names:
            s = jobs[n]
            want = (1, 1) if n in lose else (0, 0)
            assert (s.get("phase"), s.get("readyReplicas"), (s.get("generation"), s.get("restarts"))) == (
                "Running",
                4,
                want,
            ), n
            for generation in (0, 1) if n in lose else (0,):
                assert created_once(watch.records(n, generation)) == {}, (n, generation)
            assert len(watch.records(n)) == (8 if n in lose else 4), n
        assert watch.error is None
    finally:
        watch.stop()
        kubectl("delete", "dtj", *names, "-n", op.namespace, "--wait=true", "--timeout=180s")


def _jobs(op: Operator) -> list[dict[str, Any]]:
    return list(kubectl_json("get", "dtj", "-n", op.namespace)["items"])


def _phases(op: Operator) -> dict[str, int]:
    counts: dict[str, int] = {}
    for j in _jobs(op):
        phase = (j.get("status") or {}).get("phase") or "-"
        counts[phase] = counts.get(phase, 0) + 1
    return counts


def _yaml(obj: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(obj))
