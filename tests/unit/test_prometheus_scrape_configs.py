"""The chart's Prometheus scrape jobs (helm/dtjob/prometheus/scrape-configs.yaml, #43): applied as
Prometheus's pod service discovery would apply them to the pods the chart and the operator make,
they find the operator's metrics port and each worker's, and nothing else; and the devcluster's
Prometheus runs exactly these jobs. tests/e2e/test_prometheus.py scrapes with them for real."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dtjob.devcluster import prometheus
from dtjob.operator.jobview import JobView
from dtjob.operator.manifests import worker_pod
from dtjob.operator.worker_defaults import WorkerDefaults
from tests.unit.reconciler_fixtures import make_job
from tests.unit.test_chart import render

Labels = dict[str, str]


def _meta_name(label: str) -> str:
    """A Kubernetes label as Prometheus names its meta label (every other character is `_`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def sd_targets(pod: dict[str, Any], ip: str = "10.244.1.7") -> list[Labels]:
    """The targets Kubernetes service discovery (role pod) makes of a pod: one per container port
    (the meta labels these jobs read, and the address)."""
    meta = pod["metadata"]
    common = {
        "__meta_kubernetes_namespace": meta.get("namespace", "default"),
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_phase": (pod.get("status") or {}).get("phase", "Running"),
    }
    common |= {
        f"__meta_kubernetes_pod_label_{_meta_name(k)}": v for k, v in (meta.get("labels") or {}).items()
    }
    return [
        {
            **common,
            "__address__": f"{ip}:{port['containerPort']}",
            "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
        }
        for container in pod["spec"]["containers"]
        for port in container.get("ports") or []
    ]


def relabel(labels: Labels, rules: list[dict[str, Any]]) -> Labels | None:
    """Prometheus's relabelling, for the actions the chart's jobs use (keep and replace); None
    when the target is dropped."""
    out = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(out.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "drop":
            if match is not None:
                return None
        elif action == "replace":
            if match is not None:
                out[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$1", r"\1"))
        else:
            raise AssertionError(f"relabel action {action!r} is not modelled here")
    return {k: v for k, v in out.items() if not k.startswith("__meta_")}


def scraped(job_name: str, pods: list[dict[str, Any]]) -> list[Labels]:
    job = next(j for j in prometheus.chart_scrape_configs() if j["job_name"] == job_name)
    assert [sd["role"] for sd in job["kubernetes_sd_configs"]] == ["pod"]
    found = [relabel(t, job["relabel_configs"]) for pod in pods for t in sd_targets(pod)]
    return [t for t in found if t is not None]


def operator_pod() -> dict[str, Any]:
    deployment = next(d for d in render() if d["kind"] == "Deployment")
    template = deployment["spec"]["template"]
    return {
        "metadata": {**template["metadata"], "name": "dtjob-abc12", "namespace": "dtjob-system"},
        "spec": template["spec"],
    }


def a_worker_pod(rank: int) -> dict[str, Any]:
    return worker_pod(JobView(make_job()), rank=rank, world_size=2, generation=1, defaults=WorkerDefaults())


def test_the_operator_job_scrapes_the_operators_metrics_port_and_no_worker() -> None:
    pods = [operator_pod(), a_worker_pod(0), a_worker_pod(1)]
    targets = scraped("dtjob-operator", pods)
    # The operator's pod has two ports (health 8080, metrics 9401): only metrics is scraped.
    assert targets == [
        {"__address__": "10.244.1.7:9401", "operator_namespace": "dtjob-system", "pod": "dtjob-abc12"}
    ]


def test_the_operator_job_keeps_the_per_job_labels_as_served() -> None:
    """dtjob_job_*{namespace, name} are the job's; a target label `namespace` would otherwise turn
    the served one into `exported_namespace`, and the dashboard's queries would find nothing."""
    job = next(j for j in prometheus.chart_scrape_configs() if j["job_name"] == "dtjob-operator")
    assert job["honor_labels"] is True
    targets = scraped("dtjob-operator", [operator_pod()])
    assert not {"namespace", "name"} & set(targets[0])


def test_the_trainers_job_scrapes_every_worker_with_its_job_and_rank_and_not_the_operator() -> None:
    targets = scraped("dtjob-trainers", [operator_pod(), a_worker_pod(0), a_worker_pod(1)])
    assert targets == [
        {
            "__address__": "10.244.1.7:9400",
            "namespace": "ml",
            "pod": f"gpt-worker-{rank}",
            "dtjob_job": "gpt",
            "dtjob_rank": str(rank),
        }
        for rank in (0, 1)
    ]


def test_the_trainers_job_leaves_finished_worker_pods_alone() -> None:
    finished = [
        {**a_worker_pod(rank), "status": {"phase": phase}}
        for rank, phase in ((0, "Succeeded"), (1, "Failed"))
    ]
    assert scraped("dtjob-trainers", finished) == []
    assert len(scraped("dtjob-trainers", [{**a_worker_pod(0), "status": {"phase": "Pending"}}])) == 1


def test_the_devcluster_runs_the_charts_jobs_with_only_the_api_servers_address_added(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "prometheus.kubeconfig"
    config = prometheus.config(kubeconfig, prometheus.chart_scrape_configs())
    assert config["global"]["scrape_interval"] == prometheus.SCRAPE_INTERVAL
    jobs = config["scrape_configs"]
    for job in jobs:
        for sd in job["kubernetes_sd_configs"]:
            assert sd.pop("kubeconfig_file") == str(kubeconfig)
    assert jobs == prometheus.chart_scrape_configs()
    assert [j["job_name"] for j in jobs] == ["dtjob-operator", "dtjob-trainers"]


def test_the_devclusters_prometheus_may_only_read_pods() -> None:
    role, binding = prometheus.rbac_objects()
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": prometheus.USER}
    ]


def test_the_service_monitor_keeps_the_per_job_labels_as_served() -> None:
    """The Prometheus Operator gives a ServiceMonitor's targets the label `namespace` (the
    Service's): without honorLabels the operator's dtjob_job_*{namespace} would be renamed."""
    on = ["--set", "metrics.serviceMonitor.enabled=true"]
    monitor = next(d for d in render(*on) if d["kind"] == "ServiceMonitor")
    assert [e.get("honorLabels") for e in monitor["spec"]["endpoints"]] == [True]
