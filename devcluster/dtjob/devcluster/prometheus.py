"""A real Prometheus beside the devcluster (`dtjob devcluster up --prometheus`).

Built from the Go module proxy by devcluster/build-prometheus.sh on first use (version pinned in
versions.env as PROMETHEUS_VERSION, cached in $DTJOB_CACHE/bin/prometheus-v<V>/), it listens on
127.0.0.1:9090 and scrapes with the Helm chart's own scrape jobs
(helm/dtjob/prometheus/scrape-configs.yaml): Kubernetes service discovery, role pod, finds the
operator's pod (a chart install) and every worker pod. The devcluster's pods are local processes
in network namespaces on the bridge dtjob0, so their pod IPs are reachable from this machine and
Prometheus scrapes them directly. The only change to the chart's jobs is how service discovery
reaches the API server from outside the cluster: a kubeconfig of the user `dtjob:prometheus`,
whose ClusterRole holds get, list and watch on pods and nothing else (what the chart's scrape
configuration asks of an in-cluster Prometheus's ServiceAccount).
"""

from __future__ import annotations

import copy
import os
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from dtjob.devcluster import pki, processes
from dtjob.devcluster.apiclient import ApiClient
from dtjob.devcluster.binaries import (
    DEVCLUSTER_SOURCE,
    cache_dir,
    check_go_buildable,
    read_versions,
    run_go_build,
)
from dtjob.devcluster.controlplane import APISERVER_URL, last_log_line
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.layout import Layout

COMPONENT = "prometheus"
PORT = 9090
URL = f"http://127.0.0.1:{PORT}"
BUILD_SCRIPT = DEVCLUSTER_SOURCE / "build-prometheus.sh"
SCRAPE_CONFIGS = DEVCLUSTER_SOURCE.parent / "helm" / "dtjob" / "prometheus" / "scrape-configs.yaml"
USER = "dtjob:prometheus"
RBAC_API = "rbac.authorization.k8s.io"
RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
# Seconds between scrapes: a test's job of a few seconds gets several samples of each series and
# the dashboard's rates (4 samples in $__rate_interval) work over a 4 s window.
SCRAPE_INTERVAL = "1s"
READY_TIMEOUT = 120.0


def version() -> str:
    versions = read_versions()
    if "PROMETHEUS_VERSION" not in versions:
        raise DevclusterError("devcluster/versions.env does not pin PROMETHEUS_VERSION")
    return versions["PROMETHEUS_VERSION"]


def binary() -> Path:
    return cache_dir() / "bin" / f"prometheus-v{version()}" / "prometheus"


def _built() -> bool:
    return os.access(binary(), os.X_OK)


def check_buildable() -> None:
    check_go_buildable(f"Prometheus v{version()}", _built(), binary().parent, BUILD_SCRIPT)


def build_missing(log: Path) -> bool:
    """Runs the build script when Prometheus is not cached; returns whether a build ran."""
    check_buildable()
    return run_go_build(f"prometheus v{version()}", BUILD_SCRIPT, log, _built, "minutes")


def chart_scrape_configs(path: Path = SCRAPE_CONFIGS) -> list[dict[str, Any]]:
    """The chart's scrape jobs, as a user appends them to `scrape_configs:`."""
    jobs = yaml.safe_load(path.read_text())
    if not isinstance(jobs, list) or not all(isinstance(j, dict) and "job_name" in j for j in jobs):
        raise DevclusterError(f"{path} is not a list of Prometheus scrape jobs")
    return jobs


def config(kubeconfig: Path, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """prometheus.yml: the chart's jobs, each service discovery given the kubeconfig (the API
    server and credentials an in-cluster Prometheus takes from its pod), and the scrape interval."""
    jobs = copy.deepcopy(jobs)
    for job in jobs:
        for sd in job.get("kubernetes_sd_configs", []):
            sd["kubeconfig_file"] = str(kubeconfig)
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": jobs,
    }


def state_dir(layout: Layout) -> Path:
    return layout.root / "prometheus"


def command(layout: Layout, config_file: Path) -> list[str]:
    return [
        str(binary()),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={state_dir(layout) / 'data'}",
        f"--web.listen-address=127.0.0.1:{PORT}",
        "--log.level=warn",
    ]


def pid(layout: Layout) -> int | None:
    return processes.read_pid(layout.pid_file(COMPONENT), f"{layout.root}/")


def ready(timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"{URL}/-/ready", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def rbac_objects() -> list[dict[str, Any]]:
    meta = {"name": USER}
    role = {"apiVersion": f"{RBAC_API}/v1", "kind": "ClusterRole", "metadata": meta, "rules": RULES}
    binding = {
        "apiVersion": f"{RBAC_API}/v1",
        "kind": "ClusterRoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": RBAC_API, "kind": "ClusterRole", "name": USER},
        "subjects": [{"apiGroup": RBAC_API, "kind": "User", "name": USER}],
    }
    return [role, binding]


def _grant(layout: Layout) -> Path:
    """The user's certificate, kubeconfig and RBAC; returns the kubeconfig."""
    ca = pki.ensure_ca(layout.pki)
    cert = pki.ensure_cert(
        ca, pki.CertKey(layout.pki / "prometheus.crt", layout.pki / "prometheus.key"), USER, client=True
    )
    kubeconfig = layout.kubeconfig(COMPONENT)
    if not kubeconfig.exists():
        pki.write_kubeconfig(kubeconfig, APISERVER_URL, ca.cert, cert, USER)
    client = ApiClient(layout, timeout=30.0)
    for obj in rbac_objects():
        path = f"/apis/{RBAC_API}/v1/{obj['kind'].lower()}s/{obj['metadata']['name']}"
        status = client.apply(path, obj)
        if status not in (200, 201):
            raise DevclusterError(f"applying {obj['kind']} {USER} failed with HTTP {status}")
    return kubeconfig


def ensure(layout: Layout, started: list[str]) -> None:
    """Prometheus running and ready; appends "prometheus" to `started` when it started it."""
    running = pid(layout)
    if running is None:
        kubeconfig = _grant(layout)
        config_file = state_dir(layout) / "prometheus.yml"
        config_file.parent.mkdir(parents=True, exist_ok=True)
        config_file.write_text(yaml.safe_dump(config(kubeconfig, chart_scrape_configs()), sort_keys=False))
        running = processes.start(
            command(layout, config_file), layout.log(COMPONENT), layout.pid_file(COMPONENT)
        )
        started.append(COMPONENT)
    deadline = time.monotonic() + READY_TIMEOUT
    while not ready():
        if not processes.is_running(running):
            log = layout.log(COMPONENT)
            raise DevclusterError(f"prometheus exited during start-up: {last_log_line(log)} (log: {log})")
        if time.monotonic() > deadline:
            raise DevclusterError(
                f"prometheus was not ready after {READY_TIMEOUT:.0f}s; see {layout.log(COMPONENT)}"
            )
        time.sleep(0.5)


def stop(layout: Layout) -> None:
    """Stops Prometheus and deletes its data (a new cluster starts with an empty database)."""
    running = pid(layout)
    if running is not None:
        processes.stop(running)
    layout.pid_file(COMPONENT).unlink(missing_ok=True)
    shutil.rmtree(state_dir(layout), ignore_errors=True)


def status_line(layout: Layout) -> tuple[bool, str]:
    running = pid(layout)
    good = running is not None and ready()
    alive = "yes" if running else "no"
    return good, f"{COMPONENT:<26}{running or '-':>8}  {alive:<6} {'yes' if good else 'no'}  {URL}"
