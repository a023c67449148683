"""The chaos suite runs on the e2e suite's devcluster: its session fixture, imported here so tests
under tests/chaos/ see it (it starts the cluster only when none runs)."""

from tests.e2e.conftest import devcluster  # noqa: F401
