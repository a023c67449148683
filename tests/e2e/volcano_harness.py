"""What the Volcano e2e tests share: Volcano on the devcluster, queues and priority classes, and a
timeline of a job's PodGroup and pods as the real scheduler moves them.

The timeline polls once a second in a thread and keeps only the observations that changed, so a
test can assert on the order of events (no worker bound before all four were; minMember 3, 2, 3)
and the report has the PodGroup phases over time.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import yaml
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from tests.e2e.conftest import dtjob_devcluster, kubectl, wait_for
from tests.e2e.operator_harness import SCRATCH, Operator

# `up --volcano` builds vc-scheduler and vc-controller-manager on first use: about 10 minutes cold
# on 2 idle cores, 20 while the machine is busy; nothing when they are cached.
VOLCANO_UP_TIMEOUT = 2400.0
LOW, HIGH = "dtjob-volcano-low", "dtjob-volcano-high"
PRIORITIES = {LOW: 100, HIGH: 1000}


def volcano_up() -> None:
    """Adds Volcano to the running devcluster (or finds it there)."""
    started = time.monotonic()
    up = dtjob_devcluster("up", "--volcano", timeout=VOLCANO_UP_TIMEOUT)
    assert up.returncode == 0, (
        f"dtjob devcluster up --volcano failed: {up.stderr.strip() or up.stdout.strip()}"
    )
    print(f"\nvolcano e2e: `up --volcano` took {time.monotonic() - started:.1f}s: {up.stdout.strip()}")


def apply_objects(*objects: dict[str, Any]) -> None:
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects), check=True)


def priority_classes() -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
        }
        for name, value in PRIORITIES.items()
    ]


def queue(name: str, capability: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"weight": 1, "reclaimable": False}
    if capability:
        spec["capability"] = capability
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "Queue",
        "metadata": {"name": name},
        "spec": spec,
    }


def wait_queue_open(name: str) -> None:
    def is_open() -> bool:
        got = kubectl("get", "queues.scheduling.volcano.sh", name, "-o", "jsonpath={.status.state}")
        return got.stdout.strip() == "Open"

    wait_for(f"Volcano queue {name} to be Open", is_open, timeout=60)


def podgroup(op: Operator, name: str) -> dict[str, Any] | None:
    got = kubectl("get", "podgroups.scheduling.volcano.sh", name, "-n", op.namespace, "-o", "json")
    return json.loads(got.stdout) if got.returncode == 0 else None


def bound(pods: list[dict[str, Any]]) -> list[str]:
    """Names of the pods the scheduler has bound to a node."""
    return sorted(p["metadata"]["name"] for p in pods if p["spec"].get("nodeName"))


def scheduled_at(pod: dict[str, Any]) -> str | None:
    for c in pod["status"].get("conditions") or []:
        if c["type"] == "PodScheduled" and c["status"] == "True":
            return str(c.get("lastTransitionTime"))
    return None


def finished_at(pods: list[dict[str, Any]]) -> str:
    """When the last of these pods' containers ended (their resources free again)."""
    ends = [
        str(c["state"]["terminated"]["finishedAt"])
        for p in pods
        for c in p["status"].get("containerStatuses") or []
        if (c.get("state") or {}).get("terminated")
    ]
    assert len(ends) == len(pods), "a pod has not finished"
    return max(ends)


def node_action(action: str, node: str) -> None:
    done = dtjob_devcluster("node", action, node, timeout=300)
    assert done.returncode == 0, done.stderr


def node_ready(node: str) -> bool:
    got = kubectl("get", "node", node, "-o", 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')
    return got.stdout.strip() == "True"


def _pod_view(pod: dict[str, Any]) -> dict[str, Any]:
    status = pod.get("status") or {}
    exit_code = None
    for c in status.get("containerStatuses") or []:
        terminated = (c.get("state") or {}).get("terminated")
        if terminated:
            exit_code = terminated.get("exitCode")
    preempted = any(
        c.get("type") == "DisruptionTarget" and c.get("reason") == "PreemptionByScheduler"
        for c in status.get("conditions") or []
    )
    return {
        "name": pod["metadata"]["name"],
        "generation": (pod["metadata"].get("labels") or {}).get("training.dtjob.io/generation"),
        "phase": status.get("phase"),
        "node": (pod.get("spec") or {}).get("nodeName"),
        "deleting": bool(pod["metadata"].get("deletionTimestamp")),
        "exit": exit_code,
        "preempted": preempted,
    }


@dataclass
class Timeline:
    """A job's pods (from a watch: every change, the last status of a pod before it goes
    included), its PodGroup and its phase (polled every `interval` seconds), as snapshots of
    everything each time something changed."""

    op: Operator
    job: str
    interval: float = 0.5
    entries: list[dict[str, Any]] = field(default_factory=list)
    _pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    _group: dict[str, Any] = field(
        default_factory=lambda: dict.fromkeys(("job", "pg", "minMember", "running", "condition"))
    )
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _started: float = 0.0
    _api: client.ApiClient | None = None

    def __enter__(self) -> Timeline:
        self._api = config.new_client_from_config(config_file=os.environ["KUBECONFIG"])
        self._started = time.monotonic()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._watch_pods, self._poll)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)
        path = SCRATCH / f"{self.op.namespace}-{self.job}-timeline.json"
        path.write_text(json.dumps(self.entries, indent=1))
        print(f"\ntimeline of {self.job} ({path}):")
        for e in self.entries:
            print(f"  {e['t']:6.1f}s {self.line(e)}")

    @staticmethod
    def line(e: dict[str, Any]) -> str:
        def pod(p: dict[str, Any]) -> str:
            flags = [f"@{p['node']}" if p["node"] else "", " deleting" if p["deleting"] else ""]
            flags += [
                f" exit {p['exit']}" if p["exit"] is not None else "",
                " PREEMPTED" if p["preempted"] else "",
            ]
            return f"{p['name']}(g{p['generation']}) {p['phase']}{''.join(flags)}"

        group = f"PodGroup {e['pg']} minMember={e['minMember']} running={e['running']}"
        pods = "; ".join(pod(p) for p in e["pods"])
        return f"job {e['job']} | {group} | {pods} | {(e['condition'] or '')[:140]}"

    def _snapshot(self) -> None:
        with self._lock:
            seen = {**self._group, "pods": sorted(self._pods.values(), key=lambda v: v["name"])}
            previous = {k: v for k, v in self.entries[-1].items() if k != "t"} if self.entries else None
            if seen != previous:
                self.entries.append({"t": round(time.monotonic() - self._started, 1), **seen})

    def _watch_pods(self) -> None:
        """One watch, resumed from the last resourceVersion it saw, so no change is missed."""
        core = client.CoreV1Api(self._api)
        selector = f"training.dtjob.io/job-name={self.job}"
        version: str | None = None
        while not self._stop.is_set():
            try:
                events = watch.Watch().stream(
                    core.list_namespaced_pod,
                    self.op.namespace,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=5,
                )
                for event in events:
                    pod = core.api_client.sanitize_for_serialization(event["object"])
                    version = pod["metadata"].get("resourceVersion") or version
                    with self._lock:
                        if event["type"] == "DELETED":
                            self._pods.pop(pod["metadata"]["name"], None)
                        else:
                            self._pods[pod["metadata"]["name"]] = _pod_view(pod)
                    self._snapshot()
                    if self._stop.is_set():
                        break
            except ApiException as e:
                version = None if e.status == 410 else version  # too old: list again
                self._stop.wait(0.5)
            except (OSError, ValueError):
                self._stop.wait(0.5)

    def _poll(self) -> None:
        custom = client.CustomObjectsApi(self._api)
        while not self._stop.is_set():
            group = self._get(custom, "scheduling.volcano.sh", "v1beta1", "podgroups")
            job = self._get(custom, "training.dtjob.io", "v1alpha1", "distributedtrainingjobs")
            status = group.get("status") or {}
            conditions = status.get("conditions") or []
            last = conditions[-1] if conditions else {}
            with self._lock:
                self._group = {
                    "job": (job.get("status") or {}).get("phase"),
                    "pg": status.get("phase"),
                    "minMember": (group.get("spec") or {}).get("minMember"),
                    "running": status.get("running"),
                    "condition": f"{last.get('type')}: {last.get('message') or last.get('reason')}"
                    if last
                    else None,
                }
            self._snapshot()
            self._stop.wait(self.interval)

    def _get(self, custom: client.CustomObjectsApi, group: str, version: str, plural: str) -> dict[str, Any]:
        try:
            return dict(
                custom.get_namespaced_custom_object(group, version, self.op.namespace, plural, self.job)
            )
        except (ApiException, OSError, ValueError):
            return {}

    def seen(self, key: str) -> list[Any]:
        """The successive distinct values of one field."""
        out: list[Any] = []
        for e in self.entries:
            if key in e and (not out or out[-1] != e[key]):
                out.append(e[key])
        return out

    def longest_partial_gang(self, generation: str, size: int) -> float:
        """The longest time (s) that some but not all `size` pods of `generation` were bound. A
        gang placed whole is bound in one scheduling session: its pods' bindings are milliseconds
        apart, and a watch sees them one by one."""
        longest, since = 0.0, None
        for e, bound in zip(self.entries, self.bound_counts(generation), strict=True):
            if 0 < bound < size:
                since = e["t"] if since is None else since
                longest = max(longest, e["t"] - since)
            else:
                since = None
        return longest

    def bound_counts(self, generation: str) -> list[int]:
        """How many pods of `generation` were bound, at each observation."""
        return [
            sum(1 for p in e["pods"] if p["generation"] == generation and p["node"] and not p["deleting"])
            for e in self.entries
        ]

    def pod_states(self, generation: str) -> dict[str, list[dict[str, Any]]]:
        """Every observed state of each pod of `generation`, in order."""
        out: dict[str, list[dict[str, Any]]] = {}
        for e in self.entries:
            for p in e["pods"]:
                if p["generation"] == generation and (not out.get(p["name"]) or out[p["name"]][-1] != p):
                    out.setdefault(p["name"], []).append(p)
        return out
