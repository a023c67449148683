"""The same training job both ways: dtjob's trainer, same model, batch, steps and checkpoint
interval, as a DistributedTrainingJob and as a PyTorchJob whose pods run it under torchrun.

Both write checkpoints, rank 0's per-step JSON lines and read the step gate on hostPath
directories of this machine (SCRATCH/<namespace>/<job>/), so the bench sees every step of every
gang and both trainers resume from their checkpoints after a restart. Two workers, elastic bounds
[1, 2]; the workers keep to different nodes (required anti-affinity on a label of the bench's), so
stopping one worker's node stops only that worker.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.peers.kube import kubectl, kubectl_json

SCRATCH = Path(os.environ.get("DTJOB_BENCH_PEERS_SCRATCH", "/tmp/dtjob-bench-peers"))
REPLICAS, MIN_REPLICAS, MAX_REPLICAS = 2, 1, 2
MAX_RESTARTS = 20
HEARTBEAT_TIMEOUT_S = 10  # dtjob's default elastic.heartbeatTimeoutSeconds, given to both trainers
RDZV_PORT = 29400
BENCH_LABEL = "bench.dtjob.io/job"


def trainer_args(steps: int) -> list[str]:
    """The tiny GPT of the e2e tests (1 block, width 32), 12 samples a step, a checkpoint every 5."""
    return [
        "--model=gpt",
        "--layers=1",
        "--dim=32",
        "--heads=2",
        "--seq-len=32",
        f"--steps={steps}",
        "--global-batch-size=12",
        "--lr=3e-3",
        "--warmup-steps=2",
        "--checkpoint-every=5",
        "--keep-checkpoints=3",
        "--checkpoint-dir=/ckpt",
        "--log-file=/steplog/steps.jsonl",
        "--step-gate=/gate/step",
        "--rendezvous-timeout=300",
    ]


def _bench_env() -> list[dict[str, Any]]:
    return [
        {"name": "BENCH_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "BENCH_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ]


@dataclass
class StepLog:
    """Tails rank 0's step log on the host; every record is kept with the time the bench saw it
    (polled every 0.1 s: the same delay on both sides)."""

    path: Path
    records: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._tail, daemon=True)
        self._thread.start()

    def _tail(self) -> None:
        offset, partial = 0, b""
        while not self._stop.wait(0.1):
            try:
                with self.path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            now = time.time()
            offset += len(chunk)
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by SIGKILL
                if isinstance(record, dict) and "step" in record:
                    with self._lock:
                        self.records.append((now, record))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def snapshot(self) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            return list(self.records)

    def since(self, t: float) -> list[tuple[float, dict[str, Any]]]:
        return [(at, r) for at, r in self.snapshot() if at > t]

    def last_step(self) -> int:
        snap = self.snapshot()
        return int(snap[-1][1]["step"]) if snap else 0


@dataclass
class BenchJob:
    """One job of the bench, of either kind."""

    kind: str  # "dtjob" | "pytorchjob"
    name: str
    namespace: str
    steps: int

    @property
    def host(self) -> Path:
        return SCRATCH / self.namespace / self.name

    @property
    def resource(self) -> str:
        return "dtj" if self.kind == "dtjob" else "pytorchjob"

    def prepare(self) -> StepLog:
        for d in ("checkpoints", "logs", "gate"):
            (self.host / d).mkdir(parents=True, exist_ok=True)
            os.chmod(self.host / d, 0o777)
        return StepLog(self.host / "logs" / "steps.jsonl")

    def gate(self, step: int) -> None:
        """Let the gang run up to and including `step`, then wait before the next."""
        tmp = self.host / "gate" / "step.tmp"
        tmp.write_text(str(step))
        tmp.replace(self.host / "gate" / "step")

    def pod(self, index: int) -> str:
        return f"{self.name}-worker-{index}"  # both operators name worker pods so

    def _volumes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        volumes = [
            {"name": n, "hostPath": {"path": str(self.host / d)}}
            for n, d in (("steplog", "logs"), ("gate", "gate"))
        ]
        mounts = [{"name": "steplog", "mountPath": "/steplog"}, {"name": "gate", "mountPath": "/gate"}]
        return volumes, mounts

    def _pod_spec(self, container: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            # root on the devcluster: the hostPath directories belong to root
            "securityContext": {"runAsUser": 0, "runAsNonRoot": False},
            "terminationGracePeriodSeconds": 30,
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": {BENCH_LABEL: self.name}},
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ]
                }
            },
            "containers": [container],
            "volumes": volumes,
        }

    def manifest(self) -> dict[str, Any]:
        volumes, mounts = self._volumes()
        resources = {"requests": {"cpu": "500m", "memory": "256Mi"}}
        labels = {BENCH_LABEL: self.name}
        if self.kind == "dtjob":
            container = {
                "name": "trainer",
                "image": "dtjob/trainer:0.1.0",
                "command": [sys.executable, "-m", "dtjob.trainer", *trainer_args(self.steps)],
                "env": _bench_env(),
                "resources": resources,
                "volumeMounts": mounts,
            }
            return {
                "apiVersion": "training.dtjob.io/v1alpha1",
                "kind": "DistributedTrainingJob",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {
                    "replicas": REPLICAS,
                    "elastic": {
                        "minReplicas": MIN_REPLICAS,
                        "maxReplicas": MAX_REPLICAS,
                        "maxRestarts": MAX_RESTARTS,
                        "heartbeatTimeoutSeconds": HEARTBEAT_TIMEOUT_S,
                    },
                    "checkpoint": {
                        "volume": {"hostPath": {"path": str(self.host / "checkpoints")}},
                        "mountPath": "/ckpt",
                    },
                    "template": {"metadata": {"labels": labels}, "spec": self._pod_spec(container, volumes)},
                },
            }
        torchrun = str(Path(sys.executable).parent / "torchrun")
        volumes.append({"name": "ckpt", "hostPath": {"path": str(self.host / "checkpoints")}})
        mounts.append({"name": "ckpt", "mountPath": "/ckpt"})
        container = {
            # "pytorch" is the container the training-operator gives its PET_* variables and port to.
            "name": "pytorch",
            "image": "dtjob/trainer:0.1.0",
            # --nnodes, --rdzv-backend, --rdzv-endpoint, --rdzv-id and --max-restarts come from the
            # operator's PET_NNODES=1:2, PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT=<job>-worker-0:29400, ...
            "command": [torchrun, "--nproc-per-node=1", "-m", "dtjob.trainer", *trainer_args(self.steps)],
            "env": [*_bench_env(), {"name": "DTJOB_HEARTBEAT_TIMEOUT", "value": str(HEARTBEAT_TIMEOUT_S)}],
            "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT}],
            "resources": resources,
            "volumeMounts": mounts,
        }
        return {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "elasticPolicy": {
                    "rdzvBackend": "c10d",
                    "rdzvId": self.name,
                    "minReplicas": MIN_REPLICAS,
                    "maxReplicas": MAX_REPLICAS,
                    "maxRestarts": MAX_RESTARTS,
                },
                "runPolicy": {"backoffLimit": MAX_RESTARTS, "cleanPodPolicy": "None"},
                "pytorchReplicaSpecs": {
                    "Worker": {
                        "replicas": REPLICAS,
                        "restartPolicy": "OnFailure",
                        "template": {
                            "metadata": {"labels": labels},
                            "spec": self._pod_spec(container, volumes),
                        },
                    }
                },
            },
        }

    def submit(self) -> None:
        kubectl("create", "-f", "-", input=json.dumps(self.manifest()))

    def scale(self, replicas: int) -> None:
        kubectl("scale", f"{self.resource}/{self.name}", "-n", self.namespace, f"--replicas={replicas}")

    def outcome(self) -> str | None:
        """Succeeded or Failed once the job is over, else None."""
        job = kubectl_json("get", self.resource, self.name, "-n", self.namespace)
        status = job.get("status") or {}
        if self.kind == "dtjob":
            phase = status.get("phase")
            return str(phase) if phase in ("Succeeded", "Failed") else None
        for c in status.get("conditions") or []:
            if c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True":
                return str(c["type"])
        return None

    def pods(self) -> list[dict[str, Any]]:
        listed = kubectl_json("get", "pods", "-n", self.namespace, "-l", f"{BENCH_LABEL}={self.name}")
        return list(listed["items"])

    def running_pods(self) -> dict[str, dict[str, Any]]:
        return {
            p["metadata"]["name"]: p
            for p in self.pods()
            if (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")
        }

    def delete(self) -> None:
        kubectl(
            "delete",
            self.resource,
            self.name,
            "-n",
            self.namespace,
            "--wait=true",
            "--timeout=120s",
            check=False,
        )
