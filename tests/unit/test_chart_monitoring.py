"""The chart's monitoring pieces (#43): the trainers' PodMonitor, off by default, and the Grafana
dashboard, whose every query names only metrics the operator or the trainers export."""

from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry

from dtjob import contract
from dtjob.operator.metrics import OperatorMetrics
from dtjob.trainer.metrics import TrainerMetrics
from tests.unit.test_chart import CHART, NAMESPACED, render

DASHBOARD = CHART / "dashboards" / "dtjob.json"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}


def exported(registry: CollectorRegistry) -> set[str]:
    """The series names a registry exports, labelled children or not (a family with no child yet
    has no samples to list)."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_the_pod_monitor_is_off_by_default_and_scrapes_every_trainer_when_on() -> None:
    assert not [d for d in render() if d["kind"] == "PodMonitor"]
    on = ["--set", "metrics.podMonitor.enabled=true", "--set", "metrics.podMonitor.labels.release=prom"]
    monitor = next(d for d in render(*on) if d["kind"] == "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    spec = monitor["spec"]
    assert spec["selector"] == {
        "matchExpressions": [{"key": "training.dtjob.io/job-name", "operator": "Exists"}]
    }
    assert spec["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in spec["podMetricsEndpoints"]] == ["metrics"]
    namespaced = next(d for d in render(*on, *NAMESPACED) if d["kind"] == "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_every_dashboard_query_names_exported_metrics_and_every_job_metric_is_shown() -> None:
    known = exported(OperatorMetrics().registry) | exported(TrainerMetrics().registry)
    named = {name for expr in queries() for name in re.findall(r"\bdtjob_[a-z_]+\b", expr)}
    assert named, "the dashboard queries no dtjob metric"
    assert named <= known, f"not exported: {sorted(named - known)}"
    shown = {m.name for m in contract.JOB_METRICS if any(n in named for n in (m.name, m.name + "_bucket"))}
    assert shown == {m.name for m in contract.JOB_METRICS}, "a per-job metric without a panel"
    assert "dtjob_operator_jobs" in named and "dtjob_operator_write_duration_seconds_bucket" in named


def test_the_dashboard_is_importable_as_is() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "job"}
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]


def test_the_readme_table_of_per_job_metrics_is_current() -> None:
    from dtjob.operator.jobmetrics_docs import README, with_table

    text = README.read_text()
    assert with_table(text) == text, "run: python -m dtjob.operator.jobmetrics_docs"
    assert "| `dtjob_job_goodput_ratio` | gauge | `namespace`, `name` |" in text
