"""Every test runs under a per-test timeout (tests/timeouts.py): the defaults by marker, a marker
of the test's own overriding them, and a hung test failing instead of hanging."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import timeouts

ROOT = Path(__file__).resolve().parents[2]

pytest_plugins = ["pytester"]

INI = """
[pytest]
markers =
    e2e: e2e
    slow: slow
timeout = 300
timeout_func_only = true
"""


def test_default_timeout_by_marker() -> None:
    assert timeouts.default_timeout(set()) is None  # pyproject's 300 s
    assert timeouts.default_timeout({"e2e"}) == timeouts.SLOW_TIMEOUT_SECONDS
    assert timeouts.default_timeout({"slow", "parametrize"}) == timeouts.SLOW_TIMEOUT_SECONDS
    assert timeouts.default_timeout({"e2e", "timeout"}) is None


def test_this_suite_runs_under_the_timeouts(request: pytest.FixtureRequest) -> None:
    assert request.config.getini("timeout") == "300"
    assert request.config.getini("timeout_func_only") is True


def test_each_test_gets_its_timeout(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(
        """
        import pytest

        def limit(request):
            marker = request.node.get_closest_marker("timeout")
            return marker.args[0] if marker else request.config.getini("timeout")

        def test_quick(request):
            assert limit(request) == "300"

        @pytest.mark.e2e
        def test_e2e(request):
            assert limit(request) == 900

        @pytest.mark.slow
        @pytest.mark.timeout(1234)
        def test_own(request):
            assert limit(request) == 1234
        """
    )
    result = pytester.runpytest("-p", "tests.timeouts")
    result.assert_outcomes(passed=3)


def test_a_hung_test_fails_with_its_stack(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a subprocess: the timeout's signal must not reach this test's own process."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    pytester.makeini(INI)
    pytester.makepyfile(
        """
        import threading
        import pytest

        @pytest.mark.timeout(1)
        def test_hangs():
            threading.Event().wait()

        def test_next_still_runs():
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "tests.timeouts")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*Timeout*", "*test_hangs*"])
