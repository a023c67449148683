"""Every test runs under a per-test timeout (pytest-timeout), so a hung test fails with its stacks
instead of costing the whole CI budget.

The limit covers the test function, not its fixtures (pyproject: timeout_func_only): the e2e
fixtures build and start clusters (a cold Volcano or KWOK build takes 7-17 minutes on 2 cores)
and bound each of those steps with their own subprocess timeouts. Defaults, unless the test has a
`timeout` marker of its own:

- a quick test (neither `e2e` nor `slow`): pyproject's `timeout`, 300 s; the whole quick suite
  takes about a minute;
- an `e2e` or `slow` test: SLOW_TIMEOUT_SECONDS, 900 s. The longest single wait inside such a test
  is 600 s (tests/e2e/test_multiprocess_pods.py), which must fail first with its own message; the
  chaos test, the longest body, took 354-412 s for 3 rounds (bench/README.md).
"""

from __future__ import annotations

import importlib.util

import pytest

SLOW_TIMEOUT_SECONDS = 900
SLOW_MARKERS = ("e2e", "slow")


def default_timeout(marker_names: set[str]) -> int | None:
    """The timeout to add to a test with these markers; None: leave pyproject's default (or the
    test's own `timeout` marker) in force."""
    if "timeout" in marker_names:
        return None
    if marker_names & set(SLOW_MARKERS):
        return SLOW_TIMEOUT_SECONDS
    return None


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("pytest_timeout") is None:
        raise pytest.UsageError(
            "the tests need pytest-timeout for their per-test timeouts: install the dev extras "
            "(`pip install -c constraints.txt -e '.[dev]'`, as `make venv` does)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        seconds = default_timeout({mark.name for mark in item.iter_markers()})
        if seconds is not None:
            item.add_marker(pytest.mark.timeout(seconds))
