"""What the scale test (tests/e2e/test_scale.py) and bench/scale.py share: jobs whose workers
land on KWOK's simulated nodes, a watch that records every pod of a namespace as the API server
reports it, and failing a simulated worker the way a kubelet reports a crashed container.

Simulated pods run nothing, so the worker template is only what the scheduler and the operator
read: the toleration and node selector of the simulated nodes, and the requests.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dtjob.devcluster import kwok
from dtjob.devcluster.layout import APISERVER_PORT, BRIDGE, POD_NETWORK, Layout
from dtjob.operator.jobview import LABEL_GENERATION, LABEL_JOB, LABEL_RANK


def simulated_job(
    namespace: str, name: str, replicas: int, gpus: int = 0, cpu: str = "100m", max_restarts: int = 5
) -> dict[str, Any]:
    """A job whose workers go only to simulated nodes (they never run: any command will do)."""
    resources: dict[str, Any] = {"requests": {"cpu": cpu, "memory": "128Mi"}}
    if gpus:
        resources["limits"] = {"nvidia.com/gpu": str(gpus)}
    trainer = {
        "name": "trainer",
        "image": "dtjob/trainer:0.1.0",
        "command": ["sleep", "infinity"],
        "resources": resources,
    }
    return {
        "apiVersion": "training.dtjob.io/v1alpha1",
        "kind": "DistributedTrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "elastic": {"maxRestarts": max_restarts},
            "template": {
                "spec": {
                    "containers": [trainer],
                    "tolerations": [kwok.TOLERATION],
                    "nodeSelector": dict(kwok.NODE_SELECTOR),
                    "terminationGracePeriodSeconds": 5,
                }
            },
        },
    }


class Admin:
    """Just enough of the admin client for the harness, over the standard library."""

    def __init__(self, layout: Layout) -> None:
        self.base = f"https://127.0.0.1:{APISERVER_PORT}"
        self.context = ssl.create_default_context(cafile=str(layout.ca_cert))
        self.context.load_cert_chain(str(layout.pki / "admin.crt"), str(layout.pki / "admin.key"))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        timeout: float = 60,
    ) -> Any:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        request = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            request.add_header("Content-Type", content_type)
        with urllib.request.urlopen(request, timeout=timeout, context=self.context) as r:
            raw = r.read()
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()

    def text(self, path: str, timeout: float = 60) -> str:
        request = urllib.request.Request(self.base + path)
        with urllib.request.urlopen(request, timeout=timeout, context=self.context) as r:
            return str(r.read().decode())

    def stream(self, path: str) -> Any:
        request = urllib.request.Request(self.base + path)
        return urllib.request.urlopen(request, timeout=3600, context=self.context)


def fail_worker(admin: Admin, namespace: str, pod: str, exit_code: int = 1) -> None:
    """What a kubelet reports for a trainer container that crashed: phase Failed, exit code."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    terminated = {"exitCode": exit_code, "reason": "Error", "startedAt": now, "finishedAt": now}
    status = {
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "image": "dtjob/trainer:0.1.0",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"terminated": terminated},
                }
            ],
        }
    }
    admin.request(
        "PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod}/status", status, "application/merge-patch+json"
    )


@dataclass
class PodRecord:
    name: str
    uid: str
    job: str
    rank: int
    generation: int
    added: float  # time.time() when the watch reported it
    scheduled: float | None = None  # when the watch first reported it bound to a node
    running: float | None = None  # when the watch first reported it Running
    failed: float | None = None  # when the watch first reported it Failed
    deleted: float | None = None
    pod_ip: str | None = None


@dataclass
class PodWatch:
    """Every pod of one namespace as the watch reports it, from the moment it starts: one record
    per pod object (uid), so a pod created twice shows as two records of one name."""

    admin: Admin
    namespace: str
    pods: dict[str, PodRecord] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _response: Any = None
    _rv: str = ""
    error: str | None = None

    def path(self) -> str:
        """The collection watched (a subclass watches another one)."""
        return f"/api/v1/namespaces/{self.namespace}/pods"

    def start(self) -> None:
        listed = self.admin.request("GET", self.path())
        for pod in listed.get("items") or []:
            self._record("ADDED", pod)
        self._rv = str(listed["metadata"]["resourceVersion"])
        self._open()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        self._response = self.admin.stream(
            f"{self.path()}?watch=true&resourceVersion={self._rv}&allowWatchBookmarks=true"
        )

    def _lines(self) -> Any:
        """The stream's lines as they arrive (iterating the response would wait for a full
        buffer of 8 KiB, holding back the last events of a quiet stream)."""
        buffer = b""
        while True:
            chunk = self._response.read1(65536)
            if not chunk:
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            yield from (line for line in lines if line.strip())

    def _run(self) -> None:
        """Follows the watch; one the API server ends (its timeout, or a freshly started API
        server re-initializing its watch cache) goes on from the last resourceVersion seen, so no
        event is missed. An ERROR event (410: that version is gone) fails the watch."""
        try:
            while not self._stop.is_set():
                for line in self._lines():
                    if self._stop.is_set():
                        return
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        self.error = str(event.get("object"))
                        return
                    rv = ((event.get("object") or {}).get("metadata") or {}).get("resourceVersion")
                    if event.get("type") in {"ADDED", "MODIFIED", "DELETED"}:
                        self._record(event["type"], event["object"])
                    if rv:
                        self._rv = str(rv)
                if not self._stop.is_set():
                    self._open()
        except Exception as e:  # a closed stream at stop(), or a real error the test reports
            if not self._stop.is_set():
                self.error = repr(e)

    def _record(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        if LABEL_JOB not in labels:
            return
        now = time.time()
        with self._lock:
            record = self.pods.get(meta["uid"])
            if record is None:
                record = self.pods[meta["uid"]] = PodRecord(
                    meta["name"],
                    meta["uid"],
                    labels[LABEL_JOB],
                    int(labels[LABEL_RANK]),
                    int(labels[LABEL_GENERATION]),
                    now,
                )
            status = pod.get("status") or {}
            if record.scheduled is None and (pod.get("spec") or {}).get("nodeName"):
                record.scheduled = now
            if status.get("podIP"):
                record.pod_ip = status["podIP"]
            if record.running is None and status.get("phase") == "Running":
                record.running = now
            if record.failed is None and status.get("phase") == "Failed":
                record.failed = now
            if kind == "DELETED":
                record.deleted = now

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self._response.close()

    def records(self, job: str | None = None, generation: int | None = None) -> list[PodRecord]:
        with self._lock:
            return [
                r
                for r in self.pods.values()
                if (job is None or r.job == job) and (generation is None or r.generation == generation)
            ]

    def all_running(self, job: str, generation: int, size: int) -> float | None:
        """When the last of generation's `size` workers went Running (None: not all yet). Raises
        when the watch failed: what it would report is no longer true."""
        if self.error is not None:
            raise RuntimeError(f"the watch of {self.namespace}'s pods failed: {self.error}")
        records = [r for r in self.records(job, generation) if r.deleted is None]
        if len({r.rank for r in records}) < size or any(r.running is None for r in records):
            return None
        return max(r.running for r in records if r.running is not None)


def created_once(records: Iterable[PodRecord]) -> dict[str, int]:
    """Pod names that were created more than once (name -> how often): empty when every pod of the
    records was created once."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r.name] = counts.get(r.name, 0) + 1
    return {name: n for name, n in counts.items() if n > 1}


def outside_pod_network(ips: Iterable[str]) -> list[str]:
    """The addresses that are not in the devcluster's pod network, or that this machine would
    route anywhere but its own bridge (`ip route get`): traffic to them could leave the machine."""
    network = ipaddress.IPv4Network(POD_NETWORK)
    bad = []
    for ip in sorted(set(ips)):
        if ipaddress.IPv4Address(ip) not in network:
            bad.append(ip)
            continue
        route = subprocess.run(["ip", "-o", "route", "get", ip], capture_output=True, text=True, check=False)
        if f" dev {BRIDGE} " not in f" {route.stdout} ":
            bad.append(f"{ip} (routed: {route.stdout.strip() or route.stderr.strip()})")
    return bad


def wait(what: str, predicate: Any, timeout: float, interval: float = 0.25) -> float:
    """Polls predicate; returns the time.time() it held, raising TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.time()
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def operator_process_stats(pid: int) -> dict[str, float]:
    """Resident memory (now and peak) and CPU seconds (user + system) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {
        line.split(":")[0]: int(line.split()[1])
        for line in status.splitlines()
        if line.startswith(("VmRSS", "VmHWM"))
    }
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(subprocess.run(["getconf", "CLK_TCK"], capture_output=True, text=True).stdout or 100)
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    return {"rss_mb": kb.get("VmRSS", 0) / 1024, "peak_rss_mb": kb.get("VmHWM", 0) / 1024, "cpu_seconds": cpu}
