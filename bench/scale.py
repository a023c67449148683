"""The operator at scale on KWOK's simulated nodes: one job of 64, 256 and 1,024 workers, and 50,
200 and 500 jobs of 4 workers, each measured end to end from the API.

    python bench/scale.py                                  # every size, 3 repeats (make bench-scale)
    python bench/scale.py --workers 1024 --jobs --repeats 1
    python bench/scale.py --plot-only                      # table and PNG from the saved runs

Per run, a fresh operator (`dtjob operator --namespace NS`, admin credentials, as the e2e tests
run it) in a fresh namespace, on a devcluster of simulated nodes only (`up --nodes 0
--fake-nodes 128 --fake-gpus-per-node 8`; brought up when none of that shape runs):

- workers N: a job of N workers (one GPU each) created -> all N Running; then one worker fails
  (its pod's status patched to Failed, exit 1, as a kubelet reports a crash) -> the next
  generation's N workers all Running.
- jobs M: M jobs of 4 workers (1 cpu each) submitted at once (16 at a time) -> all 4M workers
  Running; then a tenth of the jobs lose a worker at once -> their next generations all Running.

Times come from a watch on the namespace's pods (when the last pod of a generation went Running),
never from the operator's log. The status lag: from a watch on the pods and one on the jobs, how
long each pod's change (Running, Failed) took to show in its job's status (readyReplicas counting
it, or the restart's next generation; dtjob.devcluster.status_lag), p50/p99 over the changes.
Beside them: the operator's reconcile latency p50/p99 (its own histogram,
dtjob_operator_reconcile_duration_seconds, over the run), the latency of its writes
(dtjob_operator_write_duration_seconds: status patches, and pod creations and deletions, each from
the pass handing it over to its answer), its peak RSS and CPU seconds,
the requests of its Kubernetes client by verb (dtjob_operator_api_requests_total), every client's
requests to the API server by verb and the API server's p99 request latency (its
apiserver_request_total and apiserver_request_duration_seconds, without WATCH and CONNECT),
and where the time of the largest run went (operator's first and last create, scheduler's last
bind, KWOK's last Running).

Runs accumulate in bench/results/scale.json (a new run of one scenario and size replaces the
saved runs of the same scenario and size); the table and bench/results/scale.png show medians.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dtjob.devcluster.host import admin_env, free_port, kubectl
from dtjob.devcluster.layout import Layout
from dtjob.devcluster.scale_harness import (
    Admin,
    PodWatch,
    created_once,
    fail_worker,
    operator_process_stats,
    outside_pod_network,
    simulated_job,
    wait,
)
from dtjob.devcluster.status_lag import JobWatch, status_lags, summary

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CRD = REPO / "crds" / "training.dtjob.io_distributedtrainingjobs.yaml"
FAKE_NODES, GPUS_PER_NODE = 128, 8
SHAPE = ("--nodes", "0", "--fake-nodes", str(FAKE_NODES), "--fake-gpus-per-node", str(GPUS_PER_NODE))
TIMEOUT = 900.0
LONG_RUNNING = {"WATCH", "CONNECT", "WATCHLIST"}
WRITES = "dtjob_operator_write_duration_seconds"


def dtjob(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dtjob.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def ensure_cluster() -> bool:
    """A devcluster of simulated nodes only; returns whether this run brought it up."""
    layout = Layout.from_env()
    try:
        config = json.loads(layout.cluster_file.read_text())
    except (OSError, ValueError):
        config = {}
    wanted = {"nodes": 0, "fake_nodes": FAKE_NODES, "fake_gpus_per_node": GPUS_PER_NODE}
    if dtjob("devcluster", "status", timeout=60).returncode == 0 and all(
        config.get(k) == v for k, v in wanted.items()
    ):
        return False
    dtjob("devcluster", "down", timeout=300)
    up = dtjob("devcluster", "up", *SHAPE)
    if up.returncode != 0:
        raise SystemExit(f"devcluster up failed: {up.stdout}{up.stderr}")
    return True


class Operator:
    def __init__(self, namespace: str, log: Path) -> None:
        self.port = free_port()
        env = admin_env()
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dtjob.cli",
                    "operator",
                    "--namespace",
                    namespace,
                    "--standalone",
                    "--liveness",
                    f"http://127.0.0.1:{free_port()}/healthz",
                    "--metrics-port",
                    str(self.port),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.log = log
        wait("the operator to serve", lambda: "serving" in log.read_text() and self._answers(), 120)

    def _answers(self) -> bool:
        try:
            self.metrics()
            return True
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


# --- metrics ---------------------------------------------------------------------------------------
def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def histogram(
    text: str, name: str, skip: set[str] | None = None, only: tuple[str, set[str]] | None = None
) -> dict[float, float]:
    """Cumulative bucket counts by upper bound, summed over every label set (but `le`), without the
    series whose verb is in `skip`, and with `only` (label, values) just the series it names."""
    buckets: dict[float, float] = {}
    for sample, labels, value in samples(text):
        if sample != f"{name}_bucket" or labels.get("verb") in (skip or set()):
            continue
        if only is not None and labels.get(only[0]) not in only[1]:
            continue
        le = float(labels["le"])
        buckets[le] = buckets.get(le, 0.0) + value
    return buckets


def counter_by(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for sample, labels, value in samples(text):
        if sample in {name, f"{name}_total"}:
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def delta(after: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """histogram_quantile over cumulative buckets (linear inside the bucket, as Prometheus)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    total, rank, lower, below = buckets[bounds[-1]], q * buckets[bounds[-1]], 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower if total else None


class Snapshot:
    def __init__(self, admin: Admin, op: Operator) -> None:
        self.operator = op.metrics()
        self.apiserver = admin.text("/metrics")
        self.process = operator_process_stats(op.proc.pid)


def measured(before: Snapshot, after: Snapshot) -> dict[str, Any]:
    reconcile = delta(
        histogram(after.operator, "dtjob_operator_reconcile_duration_seconds"),
        histogram(before.operator, "dtjob_operator_reconcile_duration_seconds"),
    )
    api = delta(
        histogram(after.apiserver, "apiserver_request_duration_seconds", LONG_RUNNING),
        histogram(before.apiserver, "apiserver_request_duration_seconds", LONG_RUNNING),
    )
    ours = delta(
        counter_by(after.operator, "dtjob_operator_api_requests", "verb"),
        counter_by(before.operator, "dtjob_operator_api_requests", "verb"),
    )
    theirs = delta(
        counter_by(after.apiserver, "apiserver_request_total", "verb"),
        counter_by(before.apiserver, "apiserver_request_total", "verb"),
    )
    writes = {
        kind: delta(
            histogram(after.operator, WRITES, only=("write", kinds)),
            histogram(before.operator, WRITES, only=("write", kinds)),
        )
        for kind, kinds in (("status", {"status"}), ("pod", {"create_pod", "delete_pod"}))
    }
    return {
        "passes": reconcile.get(float("inf"), 0.0),
        "reconcile_p50_s": quantile(reconcile, 0.5),
        "reconcile_p99_s": quantile(reconcile, 0.99),
        # From a pass handing a write over to its answer (dtjob_operator_write_duration_seconds):
        # None for an operator without that histogram, whose reconcile histogram holds the waits.
        "write_status_p50_s": quantile(writes["status"], 0.5),
        "write_status_p99_s": quantile(writes["status"], 0.99),
        "write_pod_p50_s": quantile(writes["pod"], 0.5),
        "write_pod_p99_s": quantile(writes["pod"], 0.99),
        "apiserver_p99_s": quantile(api, 0.99),
        "operator_requests": {k: int(v) for k, v in sorted(ours.items())},
        "apiserver_requests": {k: int(v) for k, v in sorted(theirs.items())},
        "operator_peak_rss_mb": round(after.process["peak_rss_mb"], 1),
        "operator_cpu_s": round(after.process["cpu_seconds"] - before.process["cpu_seconds"], 2),
    }


# --- scenarios -------------------------------------------------------------------------------------
def create_jobs(admin: Admin, namespace: str, jobs: list[dict[str, Any]]) -> None:
    path = f"/apis/training.dtjob.io/v1alpha1/namespaces/{namespace}/distributedtrainingjobs"
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda j: admin.request("POST", path, j), jobs))


def job_status(admin: Admin, namespace: str, name: str) -> dict[str, Any]:
    path = f"/apis/training.dtjob.io/v1alpha1/namespaces/{namespace}/distributedtrainingjobs/{name}"
    return dict(admin.request("GET", path).get("status") or {})


def phases(admin: Admin, namespace: str) -> dict[str, dict[str, Any]]:
    path = f"/apis/training.dtjob.io/v1alpha1/namespaces/{namespace}/distributedtrainingjobs"
    return {j["metadata"]["name"]: j.get("status") or {} for j in admin.request("GET", path)["items"]}


def timeline(watch: PodWatch, job: str | None, generation: int, start: float) -> dict[str, float]:
    records = [r for r in watch.records(job, generation)]
    if not records:
        return {}

    def last(values: list[float | None]) -> float:
        return round(max(v for v in values if v is not None) - start, 2)

    return {
        "first_created_s": round(min(r.added for r in records) - start, 2),
        "last_created_s": last([r.added for r in records]),
        "last_scheduled_s": last([r.scheduled for r in records]),
        "last_running_s": last([r.running for r in records]),
    }


def run_workers(admin: Admin, namespace: str, size: int) -> dict[str, Any]:
    watch = PodWatch(admin, namespace)
    watch.start()
    jobs = JobWatch(admin, namespace)
    jobs.start()
    try:
        start = time.time()
        create_jobs(admin, namespace, [simulated_job(namespace, "big", size, gpus=1, max_restarts=100)])
        wait("all Running", lambda: watch.all_running("big", 0, size) is not None, TIMEOUT)
        done = watch.all_running("big", 0, size) or 0.0
        created = timeline(watch, "big", 0, start)
        wait("phase Running", lambda: job_status(admin, namespace, "big").get("phase") == "Running", TIMEOUT)
        noticed = time.time() - start
        failed_at = time.time()
        fail_worker(admin, namespace, f"big-worker-{size // 2}")
        wait("generation 1 all Running", lambda: watch.all_running("big", 1, size) is not None, TIMEOUT)
        restart_done = watch.all_running("big", 1, size) or 0.0
        wait(
            "phase Running at generation 1",
            lambda: (
                (s := job_status(admin, namespace, "big")).get("phase") == "Running"
                and s.get("generation") == 1
            ),
            TIMEOUT,
        )
        old = watch.records("big", 0)
        deleted = [r.deleted for r in old if r.deleted]
        restarted = timeline(watch, "big", 1, failed_at)
        if deleted:
            restarted["last_old_deleted_s"] = round(max(deleted) - failed_at, 2)
        checks = {
            "created_once": not created_once(watch.records("big", 0))
            and not created_once(watch.records("big", 1)),
            "pods": len(watch.records("big")),
            "ips_outside_pod_network": outside_pod_network(r.pod_ip for r in watch.records() if r.pod_ip),
        }
        return {
            "created_s": round(done - start, 2),
            "status_running_s": round(noticed, 2),
            "restart_s": round(restart_done - failed_at, 2),
            "create_timeline": created,
            "restart_timeline": restarted,
            "checks": checks,
            **lag(watch, jobs),
        }
    finally:
        watch.stop()
        jobs.stop()


def lag(pods: PodWatch, jobs: JobWatch) -> dict[str, Any]:
    """A pod's change -> its job's status (dtjob.devcluster.status_lag), p99 over the pods'
    changes, each kind apart in `status_lag`."""

    def shown() -> bool:
        return all(
            v != float("inf") for vs in status_lags(pods.records(), jobs.snapshot()).values() for v in vs
        )

    # Every change shown, or 60 s more (then the unshown ones make the p99 None: unbounded).
    with contextlib.suppress(TimeoutError):
        wait("every pod change in its job's status", shown, 60, interval=1.0)
    lags = summary(status_lags(pods.records(), jobs.snapshot()))
    return {
        "status_lag_p50_s": lags["all"]["p50_s"],
        "status_lag_p99_s": lags["all"]["p99_s"],
        "status_lag": lags,
    }


def run_jobs(admin: Admin, namespace: str, count: int) -> dict[str, Any]:
    watch = PodWatch(admin, namespace)
    watch.start()
    jobs = JobWatch(admin, namespace)
    jobs.start()
    names = [f"job-{i:03d}" for i in range(count)]
    try:
        start = time.time()
        create_jobs(
            admin, namespace, [simulated_job(namespace, n, 4, cpu="1", max_restarts=100) for n in names]
        )
        wait(
            "every job's workers Running",
            lambda: all(watch.all_running(n, 0, 4) is not None for n in names),
            TIMEOUT,
        )
        done = max(r.running or 0 for r in watch.records())
        created = timeline(watch, None, 0, start)
        wait(
            "every job Running",
            lambda: all(s.get("phase") == "Running" for s in phases(admin, namespace).values()),
            TIMEOUT,
        )
        noticed = time.time() - start
        lose = names[::10]  # a tenth of the jobs, spread over the submission order
        failed_at = time.time()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda n: fail_worker(admin, namespace, f"{n}-worker-1"), lose))
        wait(
            "the failed jobs' next generations Running",
            lambda: all(watch.all_running(n, 1, 4) is not None for n in lose),
            TIMEOUT,
        )
        restart_done = max(r.running or 0 for n in lose for r in watch.records(n, 1))
        statuses = phases(admin, namespace)
        checks = {
            "created_once": all(not created_once(watch.records(n, g)) for n in names for g in (0, 1)),
            "restarted": sorted(n for n, s in statuses.items() if s.get("generation") == 1) == sorted(lose)
            or "status not yet written",
            "pods": len(watch.records()),
            "ips_outside_pod_network": outside_pod_network(r.pod_ip for r in watch.records() if r.pod_ip),
        }
        return {
            "created_s": round(done - start, 2),
            "status_running_s": round(noticed, 2),
            "restart_s": round(restart_done - failed_at, 2),
            "lost": len(lose),
            "create_timeline": created,
            "checks": checks,
            **lag(watch, jobs),
        }
    finally:
        watch.stop()
        jobs.stop()


def one_run(admin: Admin, scenario: str, size: int, repeat: int, logs: Path) -> dict[str, Any]:
    namespace = f"bench-{scenario}-{size}-{uuid.uuid4().hex[:4]}"
    kubectl("create", "namespace", namespace)
    op = Operator(namespace, logs / f"{namespace}-operator.log")
    try:
        time.sleep(2)  # kopf's start-up passes
        before = Snapshot(admin, op)
        started = time.time()
        result = (run_workers if scenario == "workers" else run_jobs)(admin, namespace, size)
        wall = time.time() - started
        after = Snapshot(admin, op)
        result.update(measured(before, after))
        result.update(
            scenario=scenario,
            size=size,
            repeat=repeat,
            wall_s=round(wall, 1),
            load=[round(x, 1) for x in os.getloadavg()],
            at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        )
        return result
    finally:
        kubectl("delete", "dtj", "--all", "-n", namespace, "--wait=true", "--timeout=600s", timeout=700)
        op.stop()
        kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=600s", timeout=700)


# --- report ----------------------------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = (
        "created_s",
        "restart_s",
        "reconcile_p50_s",
        "reconcile_p99_s",
        "write_status_p99_s",
        "write_pod_p99_s",
        "status_lag_p50_s",
        "status_lag_p99_s",
        "apiserver_p99_s",
        "operator_peak_rss_mb",
        "operator_cpu_s",
        "passes",
    )
    rows = []
    for scenario, size in sorted(
        {(r["scenario"], r["size"]) for r in runs}, key=lambda k: (k[0] != "workers", k[1])
    ):
        group = [r for r in runs if (r["scenario"], r["size"]) == (scenario, size)]
        row: dict[str, Any] = {"scenario": scenario, "size": size, "repeats": len(group)}
        for key in keys:
            values = [r[key] for r in group if r.get(key) is not None]
            row[key] = round(statistics.median(values), 3) if values else None
        for field in ("operator_requests", "apiserver_requests"):
            verbs = sorted({v for r in group for v in r.get(field, {})})
            row[field] = {v: int(statistics.median(r.get(field, {}).get(v, 0) for r in group)) for v in verbs}
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "scenario",
        "size",
        "n",
        "created s",
        "restart s",
        "rec p50 ms",
        "rec p99 ms",
        "write p99 ms status / pods",
        "pod -> status lag p50 / p99 ms",
        "api p99 ms",
        "RSS MB",
        "CPU s",
        "passes",
        "operator requests by verb",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    for r in rows:
        verbs = ", ".join(f"{k} {v}" for k, v in r["operator_requests"].items())
        cells = (
            r["scenario"],
            r["size"],
            r["repeats"],
            r["created_s"],
            r["restart_s"],
            ms(r["reconcile_p50_s"]),
            ms(r["reconcile_p99_s"]),
            f"{ms(r.get('write_status_p99_s'))} / {ms(r.get('write_pod_p99_s'))}",
            f"{ms(r.get('status_lag_p50_s'))} / {ms(r.get('status_lag_p99_s'))}",
            ms(r["apiserver_p99_s"]),
            r["operator_peak_rss_mb"],
            r["operator_cpu_s"],
            int(r["passes"] or 0),
            verbs,
        )
        lines.append(" | ".join(str(x) for x in cells))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, (scenario, label) in enumerate(
        (("workers", "workers in one job"), ("jobs", "jobs of 4 workers"))
    ):
        group = [r for r in rows if r["scenario"] == scenario]
        if not group:
            continue
        sizes = [r["size"] for r in group]
        top, bottom = axes[0][col], axes[1][col]
        for key, name in (
            ("created_s", "created -> all Running"),
            ("restart_s", "failure -> next generation Running"),
        ):
            top.plot(sizes, [r[key] for r in group], marker="o", label=name)
        top.set_xscale("log", base=2)
        top.set_xticks(sizes, [str(s) for s in sizes])
        top.set_ylabel("seconds (median)")
        top.set_title(label)
        top.legend(fontsize=8)
        for key, name in (
            ("reconcile_p50_s", "reconcile p50"),
            ("reconcile_p99_s", "reconcile p99"),
            ("apiserver_p99_s", "API server p99"),
        ):
            bottom.plot(sizes, [(r[key] or 0) * 1000 for r in group], marker="o", label=name)
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(sizes, [str(s) for s in sizes])
        bottom.set_ylabel("milliseconds")
        bottom.set_xlabel(label)
        bottom.legend(fontsize=8)
    fig.suptitle(f"dtjob operator on {FAKE_NODES} KWOK nodes: time and latency against size")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, nargs="*", default=[64, 256, 1024], help="job sizes")
    parser.add_argument("--jobs", type=int, nargs="*", default=[50, 200, 500], help="job counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    parser.add_argument("--keep-cluster", action="store_true", help="leave the devcluster up at the end")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    saved: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    runs: list[dict[str, Any]] = saved["runs"]
    if not args.plot_only:
        started = ensure_cluster()
        admin = Admin(Layout.from_env())
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
        logs = Path("/tmp/dtjob-bench-scale")
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        try:
            for scenario, sizes in (("workers", args.workers), ("jobs", args.jobs)):
                for size in sizes:
                    fresh = []
                    for repeat in range(args.repeats):
                        run = one_run(admin, scenario, size, repeat, logs)
                        print(
                            json.dumps({k: v for k, v in run.items() if k != "apiserver_requests"}),
                            flush=True,
                        )
                        fresh.append(run)
                    runs = [r for r in runs if (r["scenario"], r["size"]) != (scenario, size)] + fresh
                    write(args.out, runs)
        finally:
            if started and not args.keep_cluster:
                dtjob("devcluster", "down", timeout=300)
    rows = summarize(runs)
    write(args.out, runs)
    print(table(rows))
    return 0


def write(path: Path, runs: list[dict[str, Any]]) -> None:
    rows = summarize(runs)
    report = {
        "cluster": {"simulated_nodes": FAKE_NODES, "gpus_per_node": GPUS_PER_NODE, "nodelets": 0},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "summary": rows,
        "runs": runs,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, path.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
