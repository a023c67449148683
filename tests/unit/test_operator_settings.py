"""The operator's settings: every field documented, built from flags and the chart's environment,
bad values refused naming the field."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools

import pytest

from dtjob.operator import settings as settings_module
from dtjob.operator.main import build_settings, parse_args
from dtjob.operator.settings import ObserverSettings, OperatorSettings, ReconcilerSettings, RetrySettings
from dtjob.operator.worker_defaults import ENV_SERVICE_ACCOUNT, WorkerDefaults

SETTINGS = (OperatorSettings, ReconcilerSettings, ObserverSettings, RetrySettings)


@pytest.mark.parametrize("cls", SETTINGS, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls: type) -> None:
    tree = ast.parse(inspect.getsource(settings_module))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
    documented = {
        stmt.target.id
        for stmt, after in itertools.pairwise(body)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
        and isinstance(after.value.value, str)
        and after.value.value.strip()
    }
    assert {f.name for f in dataclasses.fields(cls)} == documented


def test_no_flags_and_no_environment_give_the_default_settings() -> None:
    assert build_settings(parse_args([]), {}) == OperatorSettings()


def test_each_tuning_flag_sets_its_field() -> None:
    # fmt: off
    argv = ["-n", "a", "-n", "b", "--standalone", "--liveness", "none", "--max-workers", "3",
            "--grow-hold-seconds", "7", "--unplanned-stop-grace-seconds", "2", "--metrics-grace-seconds", "9",
            "--node-view-lag-seconds", "4", "--cache-sync-timeout-seconds", "12", "--api-concurrency", "8",
            "--metrics-timeout-seconds", "0.25", "--scrape-workers", "4", "--scrape-interval-seconds", "2",
            "--scrape-backoff-max-seconds", "16", "--log-tail-lines", "40", "--log-reads-per-pass", "3",
            "--retry-backoff-seconds", "0.5", "--retry-backoff-max-seconds", "8"]
    # fmt: on
    built = build_settings(parse_args(argv), {ENV_SERVICE_ACCOUNT: "workers"})
    assert built == OperatorSettings(
        namespaces=("a", "b"),
        peering=None,
        liveness=None,
        max_workers=3,
        reconciler=ReconcilerSettings(
            grow_hold_seconds=7,
            unplanned_stop_grace_seconds=2,
            metrics_grace_seconds=9,
            node_view_lag_seconds=4,
            workers=WorkerDefaults(service_account="workers"),
        ),
        observer=ObserverSettings(
            cache_sync_timeout_seconds=12,
            api_concurrency=8,
            metrics_timeout_seconds=0.25,
            scrape_workers=4,
            scrape_interval_seconds=2,
            scrape_backoff_max_seconds=16,
            log_tail_lines=40,
            log_reads_per_pass=3,
        ),
        retry=RetrySettings(backoff_seconds=0.5, backoff_max_seconds=8),
    )


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--max-workers", "0"], "OperatorSettings.max_workers"),
        (["--grow-hold-seconds", "-1"], "ReconcilerSettings.grow_hold_seconds"),
        (["--metrics-timeout-seconds", "0"], "ObserverSettings.metrics_timeout_seconds"),
        (
            ["--retry-backoff-seconds", "5", "--retry-backoff-max-seconds", "1"],
            "RetrySettings.backoff_max_seconds",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_settings(parse_args(argv), {})


def test_retry_delay_doubles_up_to_the_cap() -> None:
    retry = RetrySettings(backoff_seconds=1, backoff_max_seconds=30)
    assert [retry.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
