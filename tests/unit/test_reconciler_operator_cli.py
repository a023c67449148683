"""`dtjob operator` flags and the timer's idle rule (no cluster needed)."""

from __future__ import annotations

import pytest

from dtjob.operator.handlers import needs_timer
from dtjob.operator.jobview import FINALIZER, finalized
from dtjob.operator.main import parse_args


def test_defaults_serve_every_namespace_with_peering() -> None:
    args = parse_args([])
    assert args.namespace == [] and not args.standalone and args.peering == "dtjob"
    assert args.interval == 5.0 and args.metrics_port == 9401


def test_namespaces_repeat_and_exclude_all_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["-n", "a", "--namespace", "b"]).namespace == ["a", "b"]
    with pytest.raises(SystemExit):
        parse_args(["--namespace", "a", "--all-namespaces"])
    assert "--all-namespaces" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"), [(["--interval", "0"], "--interval"), (["--metrics-port", "70000"], "--metrics-port")]
)
def test_bad_values_name_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_timer_skips_only_jobs_that_time_cannot_change() -> None:
    assert needs_timer("Running", {}) and needs_timer(None, {}) and needs_timer("Restarting", {})
    assert not needs_timer("Suspended", {})
    assert not needs_timer("Succeeded", {"runPolicy": {}})
    assert needs_timer("Failed", {"runPolicy": {"ttlSecondsAfterFinished": 60}})


def test_a_job_gets_its_first_pass_from_kopfs_event_once_kopf_put_its_finalizer_on_it() -> None:
    assert not finalized({"name": "gpt"}), "kopf's first event comes before its finalizer patch"
    assert finalized({"finalizers": ["other", FINALIZER]})
    assert finalized({"deletionTimestamp": "2026-01-01T00:00:00Z"}), "a job being deleted"
