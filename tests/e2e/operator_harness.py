"""What the operator e2e tests share: a namespace with its own operator process, tiny jobs, and
readers for the job's status, events, pods and rank 0's per-step log.

Every job writes rank 0's per-step JSON lines (`--log-file`) to a hostPath directory on this
machine, so a test sees every step of every generation, even of pods already deleted: that is
how "no step lost or repeated" is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from dtjob.devcluster.host import free_port
from tests.e2e.conftest import apply_crd, kubectl, kubectl_json, wait_for

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "training.dtjob.io_distributedtrainingjobs.yaml"
SCRATCH = Path("/tmp/dtjob-e2e-operator")


@dataclass
class Operator:
    """One `dtjob operator --namespace NS` process serving one test namespace."""

    namespace: str
    log: Path
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    peering: list[str] = field(default_factory=lambda: ["--standalone"])
    extra_args: list[str] = field(default_factory=list)  # more `dtjob operator` flags

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "operator already running"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dtjob.cli",
                    "operator",
                    "--namespace",
                    self.namespace,
                    *self.peering,
                    "--liveness",
                    f"http://127.0.0.1:{free_port()}/healthz",
                    "--metrics-port",
                    str(self.metrics_port),
                    "--interval",
                    "2",
                    *self.extra_args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        """SIGKILL: no clean-up, no goodbye, as a crashed operator."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())


def ensure_crd() -> None:
    apply_crd(CRD)


def operator_namespace(prefix: str, extra_args: list[str] | None = None) -> Iterator[Operator]:
    """A fresh namespace served by its own operator (started with `extra_args` too); on exit the
    jobs are deleted while the operator still runs (its finalizer), then the operator stops and
    the namespace goes."""
    ensure_crd()
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", namespace, check=True)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    op = Operator(namespace, SCRATCH / f"{namespace}-operator.log", extra_args=list(extra_args or []))
    op.start()
    try:
        yield op
    finally:
        if op.proc is None or op.proc.poll() is not None:
            op.start()
        kubectl("delete", "dtj", "--all", "-n", namespace, "--wait=true", "--timeout=60s")
        op.stop()
        kubectl("delete", "namespace", namespace, "--wait=false")
        shutil.rmtree(SCRATCH / namespace, ignore_errors=True)


def job_manifest(
    op: Operator,
    name: str,
    replicas: int,
    steps: int = 40,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    max_restarts: int = 5,
    cpu: str = "500m",
    command: list[str] | None = None,
    checkpoint_every: int = 5,
    gate: int | None = None,
    trainer_args: list[str] | None = None,
    restart_in_place: bool | None = None,
    **spec_extra: Any,
) -> dict[str, Any]:
    """A tiny GPT job (1 block, width 32): a step takes a fraction of a second on this machine.
    Checkpoints and rank 0's step log go to SCRATCH/<namespace>/<name>/ on the host.

    gate: the trainers run up to this step and wait there (the step gate, SCRATCH/<ns>/<name>/gate)
    until `open_gate` lets them further, so a test acts at the step it chooses.
    trainer_args: more trainer flags after the defaults (a later flag wins: `--layers=2`).
    restart_in_place: elastic.restartInPlace (None: unset, on for dtjob's trainer)."""
    host = SCRATCH / op.namespace / name
    (host / "checkpoints").mkdir(parents=True, exist_ok=True)
    (host / "logs").mkdir(parents=True, exist_ok=True)
    os.chmod(host / "logs", 0o777)
    trainer_args = [
        "--model=gpt",
        "--layers=1",
        "--dim=32",
        "--heads=2",
        "--seq-len=32",
        f"--steps={steps}",
        "--global-batch-size=12",
        "--lr=3e-3",
        "--warmup-steps=2",
        f"--checkpoint-every={checkpoint_every}",
        "--keep-checkpoints=3",
        "--log-file=/steplog/steps.jsonl",
        "--rendezvous-timeout=120",
        *(trainer_args or []),
    ]
    container: dict[str, Any] = {
        "name": "trainer",
        "image": "dtjob/trainer:0.1.0",
        "command": command or [sys.executable, "-m", "dtjob.trainer", *trainer_args],
        "resources": {"requests": {"cpu": cpu, "memory": "256Mi"}},
        "volumeMounts": [{"name": "steplog", "mountPath": "/steplog"}],
    }
    if gate is not None:
        open_gate(op, name, gate)
        container["env"] = [{"name": "DTJOB_STEP_GATE", "value": str(host / "gate")}]
    elastic: dict[str, Any] = {"maxRestarts": max_restarts, "unschedulableTimeoutSeconds": 20}
    if min_replicas is not None:
        elastic["minReplicas"] = min_replicas
    if max_replicas is not None:
        elastic["maxReplicas"] = max_replicas
    if restart_in_place is not None:
        elastic["restartInPlace"] = restart_in_place
    spec: dict[str, Any] = {
        "replicas": replicas,
        "elastic": elastic,
        "checkpoint": {"volume": {"hostPath": {"path": str(host / "checkpoints")}}, "mountPath": "/ckpt"},
        "template": {
            "spec": {
                # root on the devcluster: the hostPath directories belong to root
                "securityContext": {"runAsUser": 0, "runAsNonRoot": False},
                "terminationGracePeriodSeconds": 30,
                "containers": [container],
                "volumes": [{"name": "steplog", "hostPath": {"path": str(host / "logs")}}],
            }
        },
    }
    spec.update(spec_extra)
    return {
        "apiVersion": "training.dtjob.io/v1alpha1",
        "kind": "DistributedTrainingJob",
        "metadata": {"name": name, "namespace": op.namespace},
        "spec": spec,
    }


def open_gate(op: Operator, name: str, step: int) -> None:
    """Let the job's trainers run up to `step` (they wait before each later one)."""
    (SCRATCH / op.namespace / name / "gate").write_text(str(step))


def apply(manifest: dict[str, Any]) -> None:
    kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=True)


def job(op: Operator, name: str) -> dict[str, Any]:
    return dict(kubectl_json("get", "dtj", name, "-n", op.namespace))


def status(op: Operator, name: str) -> dict[str, Any]:
    return job(op, name).get("status") or {}


def wait_status(op: Operator, name: str, what: str, predicate: Any, timeout: float = 150.0) -> dict[str, Any]:
    """Polls the job's status until predicate(status) holds; returns that status."""
    seen: dict[str, Any] = {}

    def check() -> bool:
        seen.clear()
        seen.update(status(op, name))
        return bool(predicate(seen))

    try:
        wait_for(f"{name}: {what}", check, timeout=timeout, interval=1.0)
    except BaseException:
        print(f"last status of {name}: {json.dumps(seen, indent=1)}")
        print(op.log.read_text()[-4000:])
        raise
    return dict(seen)


def wait_phase(op: Operator, name: str, phase: str, timeout: float = 150.0) -> dict[str, Any]:
    return wait_status(op, name, f"phase {phase}", lambda s: s.get("phase") == phase, timeout)


def pods(op: Operator, name: str) -> list[dict[str, Any]]:
    listed = kubectl_json("get", "pods", "-n", op.namespace, "-l", f"training.dtjob.io/job-name={name}")
    return list(listed["items"])


def events(op: Operator, name: str) -> list[dict[str, Any]]:
    listed = kubectl_json(
        "get", "events", "-n", op.namespace, "--field-selector", f"involvedObject.name={name}"
    )
    return list(listed["items"])


def step_log(op: Operator, name: str) -> list[dict[str, Any]]:
    """Every step rank 0 logged, in order, over all generations."""
    path = SCRATCH / op.namespace / name / "logs" / "steps.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by SIGKILL
    return [r for r in out if "step" in r]


def wait_step(op: Operator, name: str, step: int, timeout: float = 150.0) -> None:
    wait_for(
        f"{name}: rank 0 at step {step}",
        lambda: any(r["step"] >= step for r in step_log(op, name)),
        timeout=timeout,
        interval=0.5,
    )


def trainer_pids(op: Operator, name: str, rank: int, program: bytes = b"dtjob.trainer") -> list[int]:
    """Host pids of a worker's trainer processes (pods are local processes on the devcluster):
    those whose command line names `program` and whose environment says RANK=rank."""
    wanted = {f"DTJOB_JOB_NAME={name}", f"DTJOB_NAMESPACE={op.namespace}", f"RANK={rank}"}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if wanted <= env and program in cmdline and b"dtjob.launcher" not in cmdline:
            found.append(int(proc.name))
    return found


def ready_standbys(op: Operator, name: str) -> int:
    """Warm standbys of the job's pods that are ready to become trainers (their title says so)."""
    wanted = {f"DTJOB_JOB_NAME={name}", f"DTJOB_NAMESPACE={op.namespace}"}
    count = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if b"dtjob.launcher.standby (ready)" not in cmdline.replace(b"\0", b" "):
                continue
            env = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            continue
        count += wanted <= env
    return count


def sigkill_worker(op: Operator, name: str, rank: int, program: bytes = b"dtjob.trainer") -> float:
    """SIGKILL the trainer process of global rank `rank`; returns the time.time() of the kill."""
    pids = trainer_pids(op, name, rank, program)
    if not pids:
        pytest.fail(f"no trainer process of {name} rank {rank} found on this machine")
    killed_at = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return killed_at


def devcluster_node(action: str, name: str) -> None:
    """`dtjob devcluster node stop|start NAME` (node loss: its lease stops, its pods are killed)."""
    done = subprocess.run(
        [sys.executable, "-m", "dtjob.cli", "devcluster", "node", action, name],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def condition(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c.get("type") == ctype), {})
