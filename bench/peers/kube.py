"""What the peers bench needs from the devcluster: kubectl, object watches, and the host side of
pods (the nodelet runs every container as a local process, so a pod's processes are found in
/proc by their environment and signalled directly, as tests/e2e/operator_harness.py does)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.host import admin_env
from dtjob.devcluster.host import kubectl as admin_kubectl
from dtjob.devcluster.layout import Layout

KUBECTL_TIMEOUT = 120.0


class BenchError(Exception):
    """Something the bench cannot work around; the message says what and where to look."""


def layout() -> Layout:
    return Layout.from_env()


def kubectl_path() -> str:
    return str(Binaries.pinned().path("kubectl"))


def kubectl(
    *args: str, input: str | None = None, check: bool = True, timeout: float = KUBECTL_TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """The admin kubectl; with `check`, a non-zero exit raises BenchError with kubectl's stderr."""
    result = admin_kubectl(*args, input=input, timeout=timeout)
    if check and result.returncode != 0:
        raise BenchError(f"kubectl {' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result


def kubectl_json(*args: str) -> Any:
    return json.loads(kubectl(*args, "-o", "json").stdout)


def apply_docs(docs: list[dict[str, Any]], server_side: bool = False) -> None:
    text = "\n".join(json.dumps(d) for d in docs)
    extra = ["--server-side", "--force-conflicts"] if server_side else []
    kubectl("apply", *extra, "-f", "-", input=text)


def wait_for(what: str, predicate: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """Polls predicate until it returns something truthy; returns it. BenchError on timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (BenchError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            last_error = e
        time.sleep(interval)
    raise BenchError(
        f"timed out after {timeout:g}s waiting for {what}" + (f" ({last_error})" if last_error else "")
    )


def devcluster(*args: str, timeout: float = 600.0) -> None:
    """`dtjob devcluster ARGS` with this interpreter (node stop/start)."""
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "dtjob.cli", "devcluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise BenchError(
            f"dtjob devcluster {' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}"
        )


@dataclass
class Created:
    """Every object of one kind the API server showed in a namespace (a watch from before the job
    was submitted), by uid: how many pods and Services a job made over its whole run."""

    namespace: str
    resource: str
    uids: dict[str, str] = field(default_factory=dict)  # uid -> name
    proc: subprocess.Popen[str] | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                kubectl_path(),
                "get",
                self.resource,
                "-n",
                self.namespace,
                "--watch",
                "--output-watch-events",
                "-o",
                'jsonpath={.object.metadata.uid} {.object.metadata.name}{"\\n"}',
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=admin_env(),
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if len(parts) == 2:
                self.uids.setdefault(parts[0], parts[1])

    def stop(self) -> int:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=10)
        return len(self.uids)


# --- host processes -------------------------------------------------------------------------------


def _environ(pid: str) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def pod_pids(namespace: str, pod: str, program: bytes) -> list[int]:
    """Host pids of the processes of pod `pod` whose command line names `program`. Every bench
    container has BENCH_POD and BENCH_NAMESPACE in its environment (from fieldRefs), inherited by
    the processes torchrun starts."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if program not in cmdline:
                continue
            env = _environ(proc.name)
        except OSError:
            continue
        if env.get("BENCH_POD") == pod and env.get("BENCH_NAMESPACE") == namespace:
            found.append(int(proc.name))
    return found


def trainer_pids(namespace: str, pod: str) -> list[int]:
    """The dtjob trainer processes of a pod: not the agent that runs them (torchrun; dtjob's
    launcher, and its standbys until one becomes a trainer and takes the trainer's command line)."""
    pids = pod_pids(namespace, pod, b"dtjob.trainer")
    agents = (b"torchrun", b"dtjob.launcher")
    return [p for p in pids if not any(a in Path(f"/proc/{p}/cmdline").read_bytes() for a in agents)]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass
class ProcessUsage:
    """CPU seconds (user + system) and resident memory of one host process, sampled."""

    pid: int
    peak_rss_bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (stat fields 14 and 15)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def start_sampling(self, interval: float = 0.5) -> None:
        self.peak_rss_bytes = self.rss_bytes()
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(interval):
                try:
                    self.peak_rss_bytes = max(self.peak_rss_bytes, self.rss_bytes())
                except OSError:
                    return

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop_sampling(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return self.peak_rss_bytes


def machine_load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])
