"""A healthy operator exports its error counter at zero (#43): the dashboard's "Operator reconcile
errors" panel shows 0 instead of "No data", which looks like a broken scrape."""

from __future__ import annotations

from dtjob.operator.metrics import RECONCILE_STAGES, OperatorMetrics
from dtjob.operator.passes import STAGE_REASONS


def test_reconcile_errors_are_zero_for_every_stage_before_any_failure() -> None:
    assert set(RECONCILE_STAGES) == set(STAGE_REASONS), "a stage of passes.py without its series"
    registry = OperatorMetrics().registry
    for stage in RECONCILE_STAGES:
        assert registry.get_sample_value("dtjob_operator_reconcile_errors_total", {"stage": stage}) == 0.0
