"""Shared by every test directory: the per-test timeouts (tests/timeouts.py)."""

from tests.timeouts import pytest_collection_modifyitems, pytest_configure

__all__ = ["pytest_collection_modifyitems", "pytest_configure"]
