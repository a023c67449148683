"""`make test` lints first (seconds), before it builds clusters or runs any test."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(target: str) -> list[str]:
    """The commands `make -n` prints for `target` (recursive makes included), in order."""
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in done.stdout.splitlines() if line.strip()]


def test_make_test_lints_before_anything_else() -> None:
    commands = _dry_run("test")
    lint = [
        i for i, c in enumerate(commands) if "ruff check" in c or "ruff format --check" in c or "mypy" in c
    ]
    later = [i for i, c in enumerate(commands) if "build-binaries.sh" in c or "-m pytest" in c]
    assert len(lint) == 3, commands
    assert later and max(lint) < min(later), commands
