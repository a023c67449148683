"""A real Prometheus (`dtjob devcluster up --prometheus`, #43) scraping a chart install of the
operator and its trainers through Kubernetes service discovery, with the chart's own scrape jobs.

One job (2 workers, 40 steps) runs with a fault (rank 1's trainer SIGKILLed at step 8): the job's
goodput and its recovery histogram are queryable through Prometheus's HTTP API and agree with the
job's status, both trainer pods are scraped with their job and rank, and every query of every
panel of the chart's Grafana dashboard returns at least one series over the job's run.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtjob.devcluster import prometheus
from tests.e2e.conftest import Devcluster, dtjob_devcluster, helm, kubectl, wait_for
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    ensure_crd,
    job_manifest,
    open_gate,
    sigkill_worker,
    status,
    wait_phase,
    wait_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "dtjob"
DASHBOARD = CHART / "dashboards" / "dtjob.json"
RELEASE = "dtjob-prom"
SYSTEM_NS = "dtjob-prom-system"
JOBS_NS = "dtjob-prom-jobs"
# A cold build of Prometheus (downloads and compile) on the shared 2-core machine; a cached one
# makes `up --prometheus` take seconds.
BUILD_AND_UP_TIMEOUT = 2400.0
# Grafana's $__rate_interval is at least 4 scrape intervals (1 s here).
RATE_INTERVAL = "4s"


def query(path: str, **params: str) -> list[dict[str, Any]]:
    url = f"{prometheus.URL}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def instant(expr: str) -> list[dict[str, Any]]:
    return query("query", query=expr)


@pytest.fixture(scope="module")
def release(devcluster: Devcluster) -> Iterator[None]:
    up = dtjob_devcluster("up", "--prometheus", timeout=BUILD_AND_UP_TIMEOUT)
    assert up.returncode == 0, up.stderr or up.stdout
    ensure_crd()
    helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait", timeout=300)
    # An earlier run's namespaces may still be terminating: helm cannot install into one.
    kubectl("delete", "namespace", JOBS_NS, SYSTEM_NS, "--ignore-not-found", "--wait=true", timeout=180)
    kubectl("create", "namespace", JOBS_NS, check=True)
    shutil.rmtree(SCRATCH / JOBS_NS, ignore_errors=True)  # an earlier run's step log and checkpoints
    helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        SYSTEM_NS,
        "--create-namespace",
        "--wait",
        "--timeout",
        "180s",
        "--set",
        f"watchNamespaces={{{JOBS_NS}}}",
        "--set",
        "operator.interval=2",
        check=True,
        timeout=300,
    )
    try:
        yield
    finally:
        kubectl("delete", "dtj", "--all", "-n", JOBS_NS, "--wait=true", "--timeout=60s")
        helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait", timeout=300)
        kubectl("delete", "namespace", JOBS_NS, SYSTEM_NS, "--wait=false")
        shutil.rmtree(SCRATCH / JOBS_NS, ignore_errors=True)


def panel_queries(namespace: str, name: str, window_seconds: int) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, its variables substituted as
    Grafana would for this job over a window of `window_seconds`."""
    values = {
        "$namespace": namespace,
        "$job": name,
        "$__range": f"{window_seconds}s",
        "$__rate_interval": RATE_INTERVAL,
    }
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable in values:
                expr = expr.replace(variable, values[variable])
            assert "$" not in expr, f"{panel['title']}: a variable left in {expr}"
            out.append((panel["title"], expr))
    return out


def test_goodput_recoveries_and_every_dashboard_panel_through_prometheus(release: None) -> None:
    op = Operator(JOBS_NS, SCRATCH / f"{JOBS_NS}-unused.log")  # the chart's operator serves JOBS_NS
    name, steps = "prom", 40
    # --peak-tflops: MFU needs the device's peak, unknown for a CPU; 0.01 TFLOP/s keeps it well below 1.
    manifest = job_manifest(
        op, name, replicas=2, steps=steps, checkpoint_every=5, gate=8, trainer_args=["--peak-tflops=0.01"]
    )
    started = time.time()
    apply(manifest)
    wait_step(op, name, 8)
    sigkill_worker(op, name, rank=1)
    open_gate(op, name, steps)
    done = wait_phase(op, name, "Succeeded", timeout=300)
    recoveries = done.get("recoveries") or []
    assert recoveries, f"no recovery on the status: {json.dumps(done)}"
    cause = recoveries[-1]["cause"]

    selector = f'namespace="{JOBS_NS}", name="{name}"'
    # The last status the operator wrote reaches Prometheus at the next scrape (1 s).
    wait_for(
        "Prometheus to have the job's final goodput",
        lambda: (
            [float(s["value"][1]) for s in instant(f"dtjob_job_goodput_ratio{{{selector}}}")]
            == [float(status(op, name)["goodput"]["ratio"])]
        ),
        timeout=30,
    )
    (goodput,) = instant(f"dtjob_job_goodput_ratio{{{selector}}}")
    assert 0.0 < float(goodput["value"][1]) < 1.0, "a faulted job's goodput is strictly between 0 and 1"
    counts = instant(f"dtjob_job_recovery_seconds_count{{{selector}}}")
    assert {s["metric"]["cause"]: float(s["value"][1]) for s in counts} == {cause: float(len(recoveries))}
    (downtime,) = instant(f"dtjob_job_recovery_seconds_sum{{{selector}}}")
    # The status rounds each downtime to 0.1 s.
    want = sum(r["downtimeSeconds"] for r in recoveries)
    assert math.isclose(float(downtime["value"][1]), want, abs_tol=0.06 * len(recoveries) + 1e-9)
    (restarts,) = instant(f"dtjob_job_restarts_total{{{selector}}}")
    assert restarts["metric"]["cause"] == cause and float(restarts["value"][1]) == len(recoveries)

    end = time.time()
    window = math.ceil(end - started) + 5
    # The trainers' own endpoints, found through service discovery while they ran (a finished
    # pod is no target): both ranks, labelled; and both jobs' targets answered.
    trainers = f'dtjob_job="{name}", namespace="{JOBS_NS}"'
    ranks = instant(f"max by (dtjob_rank) (max_over_time(dtjob_trainer_step{{{trainers}}}[{window}s]))")
    assert sorted(s["metric"]["dtjob_rank"] for s in ranks) == ["0", "1"]
    answered = instant(f'max by (job) (max_over_time(up{{job=~"dtjob-.*"}}[{window}s])) == 1')
    assert {s["metric"]["job"] for s in answered} == {"dtjob-operator", "dtjob-trainers"}
    empty = []
    for title, expr in panel_queries(JOBS_NS, name, window):
        found = query("query_range", query=expr, start=f"{started - 5:.3f}", end=f"{end:.3f}", step="1")
        if not found:
            empty.append(f"{title}: {expr}")
    assert not empty, "dashboard queries without a series over the job's run:\n" + "\n".join(empty)
