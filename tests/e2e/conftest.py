"""Shared e2e fixtures: the `devcluster` session fixture and kubectl/helm helpers.

Usage in a test module:

    from tests.e2e.conftest import kubectl, kubectl_json, wait_for

    @pytest.mark.e2e
    def test_something(devcluster: Devcluster) -> None:
        out = kubectl("get", "nodes", "-o", "name", check=True).stdout

The fixture brings the cluster up when none is running (3 nodes, 2 GPUs, 4 cpus, 8Gi each),
exports KUBECONFIG and PATH (the cluster's kubectl and helm first) into os.environ so subprocesses
talk to it, and takes it down at the end only if it started it and no other pytest session on this
machine still uses it. Tests marked `devcluster_restart` (they take the cluster down and up again)
run after every other test of the session, so they never wipe state another test set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.layout import Layout

# `up` from nothing builds no binary (the Makefile's `binaries` target did) but still starts etcd,
# the API server and 3 nodelets on a loaded 2-core machine.
UP_TIMEOUT = 600.0
KUBECTL_TIMEOUT = 120.0
DEFAULT_SHAPE = ("--nodes", "3", "--gpus-per-node", "2", "--cpus-per-node", "4", "--memory-per-node", "8Gi")


@dataclass(frozen=True)
class Devcluster:
    """What the session fixture hands to tests."""

    layout: Layout
    kubeconfig: Path
    binaries: Binaries
    started_here: bool
    host_before: dict[str, set[str]]  # host_resources() before this session's `up` (if it ran one)


def dtjob_devcluster(
    *args: str, env: dict[str, str] | None = None, timeout: float = UP_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Runs `dtjob devcluster ARGS` with this interpreter; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "dtjob.cli", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def kubectl(
    *args: str, input: str | None = None, check: bool = False, timeout: float = KUBECTL_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Runs the cluster's kubectl (KUBECONFIG from the environment the fixture exported).
    With check=True a non-zero exit fails the test with kubectl's stderr."""
    result = subprocess.run(
        [str(Binaries.pinned().path("kubectl")), *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and result.returncode != 0:
        pytest.fail(f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def kubectl_json(*args: str) -> Any:
    """`kubectl ARGS -o json`, parsed; fails the test when kubectl fails."""
    return json.loads(kubectl(*args, "-o", "json", check=True).stdout)


def helm(
    *args: str, check: bool = False, timeout: float = KUBECTL_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Runs the cluster's helm (KUBECONFIG from the environment)."""
    result = subprocess.run(
        [str(Binaries.pinned().path("helm")), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
    return result


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 60.0, interval: float = 0.5) -> None:
    """Polls predicate until it is true; fails the test naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


def job_diagnostics(namespace: str, name: str) -> str:
    """What a person would look at when a job went wrong: its phase and conditions, its events
    and each worker's log tail (issue #46: a failed job's test says why)."""
    job = kubectl("get", "dtj", name, "-n", namespace, "-o", "json")
    status = (json.loads(job.stdout).get("status") or {}) if job.returncode == 0 else {}
    lines = [f"job {namespace}/{name}: phase {status.get('phase')}"]
    lines += [
        f"  condition {c.get('type')}={c.get('status')} {c.get('reason')}: {c.get('message')}"
        for c in status.get("conditions") or []
    ]
    selector = f"involvedObject.kind=DistributedTrainingJob,involvedObject.name={name}"
    events = kubectl("get", "events", "-n", namespace, "--field-selector", selector, "-o", "json")
    for e in json.loads(events.stdout).get("items", []) if events.returncode == 0 else []:
        lines.append(f"  event {e.get('type')} {e.get('reason')}: {e.get('message')}")
    pods = kubectl("get", "pods", "-n", namespace, "-l", f"training.dtjob.io/job-name={name}", "-o", "json")
    for pod in json.loads(pods.stdout).get("items", []) if pods.returncode == 0 else []:
        pod_name = pod["metadata"]["name"]
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        states = ", ".join(f"{c.get('name')} {json.dumps(c.get('state'))}" for c in statuses)
        lines.append(f"  pod {pod_name} {(pod.get('status') or {}).get('phase')}: {states}")
        log = kubectl("logs", "-n", namespace, pod_name, "--all-containers", "--tail=40")
        lines += [f"    | {line}" for line in (log.stdout or log.stderr).splitlines()]
    return "\n".join(lines)


def wait_for_phase(namespace: str, name: str, want: str, timeout: float) -> None:
    """Waits for the job's phase `want`; fails at once on another final phase, and either way
    with the job's diagnostics."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        job = kubectl("get", "dtj", name, "-n", namespace, "-o", "json")
        seen = (json.loads(job.stdout).get("status") or {}).get("phase") if job.returncode == 0 else None
        if seen == want:
            return
        if seen in ("Succeeded", "Failed"):
            break
        time.sleep(1.0)
    why = f"ended {seen}" if seen in ("Succeeded", "Failed") else f"timed out after {timeout:.0f}s"
    pytest.fail(f"job {namespace}/{name} {why} waiting for {want}\n{job_diagnostics(namespace, name)}")


def volcano_podgroup_crd() -> Path:
    """Volcano's PodGroup CRD from the shared fixtures (`shared/fixtures/volcano/` beside the checkout).

    `shared/` sits beside the work tree; a clone made elsewhere (`git clone . /tmp/x`, as CI does)
    finds it beside the repository it was cloned from. A missing fixture fails the test: a skip
    would let CI pass without it.
    """
    repo = Path(__file__).resolve().parents[2]
    origin = subprocess.run(
        ["git", "-C", str(repo), "remote", "get-url", "origin"], capture_output=True, text=True
    ).stdout.strip()
    roots = [repo.parent] + ([Path(origin).resolve().parent] if origin and Path(origin).is_dir() else [])
    candidates = [
        root / "shared" / "fixtures" / "volcano" / "scheduling.volcano.sh_podgroups.yaml" for root in roots
    ]
    found = next((c for c in candidates if c.is_file()), None)
    assert found, f"Volcano's PodGroup CRD is missing; looked at {', '.join(map(str, candidates))}"
    return found


def apply_crd(path: Path, timeout: float = 60.0) -> None:
    """Server-side apply a CRD (ours is larger than client-side apply's annotation allows) and
    wait until it is Established. Polled: `kubectl wait --for=condition=Established` fails at
    once ("conditions accessor error") while a just-created CRD has no status yet."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path), check=True)
    name = kubectl("get", "-f", str(path), "-o", "jsonpath={.metadata.name}", check=True).stdout.strip()
    established = '{.status.conditions[?(@.type=="Established")].status}'
    wait_for(
        f"CRD {name} to be Established",
        lambda: kubectl("get", f"crd/{name}", "-o", f"jsonpath={established}").stdout == "True",
        timeout=timeout,
    )


def _lines(argv: list[str]) -> set[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    return {line.split()[0] for line in result.stdout.splitlines() if line.strip()}


def host_resources() -> dict[str, set[str]]:
    """What a cluster could leave behind on the host: network namespaces, /etc/netns entries,
    veth and bridge interfaces, and mount points."""
    etc_netns = Path("/etc/netns")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    return {
        "netns": _lines(["ip", "netns", "list"]),
        "etc_netns": {p.name for p in etc_netns.iterdir()} if etc_netns.is_dir() else set(),
        "links": {line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line},
        "mounts": {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()},
    }


def _session_file(layout: Layout) -> Path:
    return layout.root / "sessions" / str(os.getpid())


def other_live_sessions(layout: Layout) -> list[int]:
    """Pids of other pytest sessions that registered as users of this cluster and still run. A
    session killed before its teardown leaves its file behind, and its pid may be reused by any
    process: only a process still running pytest counts."""
    sessions = layout.root / "sessions"
    pids = [int(p.name) for p in sessions.iterdir() if p.name.isdigit()] if sessions.is_dir() else []
    return [pid for pid in pids if pid != os.getpid() and _runs_pytest(pid)]


def _runs_pytest(pid: int) -> bool:
    try:
        return b"pytest" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone
        return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "devcluster_restart: takes the devcluster down and up again; runs after all other tests"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    restarts = [item for item in items if item.get_closest_marker("devcluster_restart")]
    for item in restarts:
        items.remove(item)
    items.extend(restarts)


@pytest.fixture(scope="session")
def devcluster() -> Iterator[Devcluster]:
    layout = Layout.from_env()
    binaries = Binaries.pinned()
    host_before = host_resources()
    status = dtjob_devcluster("status", timeout=60)
    started_here = "no cluster is running" in status.stdout
    up = dtjob_devcluster("up", *(DEFAULT_SHAPE if started_here else ()))
    if up.returncode != 0:
        if started_here:
            dtjob_devcluster("down", timeout=300)
        pytest.fail(f"dtjob devcluster up failed: {up.stderr.strip() or up.stdout.strip()}")
    session = _session_file(layout)
    session.parent.mkdir(parents=True, exist_ok=True)
    session.write_text("pytest\n")
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    os.environ["KUBECONFIG"] = str(layout.admin_kubeconfig)
    os.environ["PATH"] = os.pathsep.join([str(binaries.k8s_dir), str(binaries.helm_dir), saved["PATH"] or ""])
    try:
        yield Devcluster(layout, layout.admin_kubeconfig, binaries, started_here, host_before)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        session.unlink(missing_ok=True)
        if started_here and not other_live_sessions(layout):
            dtjob_devcluster("down", timeout=300)
