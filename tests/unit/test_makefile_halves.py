"""`make test` runs its two halves at once: the e2e tests (the critical path, mostly waiting on the
cluster) and every other test followed by the floor run; the slow installs and builds that no test
waits for at once start in the background before them."""

from __future__ import annotations

import re
import subprocess

from tests.unit.test_makefile import ROOT


def _dry_run(target: str) -> list[str]:
    """The commands `make -n -B` prints for `target`, every file target out of date (as in a fresh
    clone, whatever this checkout has installed), recursive makes included, in order; a command
    continued over lines (a trailing backslash) is one string."""
    done = subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    joined = re.sub(r"\\\n\s*", " ", done.stdout)
    return [line for line in joined.splitlines() if line.strip()]


def _index(commands: list[str], pattern: str) -> int:
    """Index of the first command matching the regular expression; fails naming it."""
    found = [i for i, c in enumerate(commands) if re.search(pattern, c)]
    assert found, f"no command matches {pattern!r}: {commands}"
    return found[0]


def test_make_test_runs_the_e2e_and_the_local_half_in_one_parallel_make() -> None:
    commands = _dry_run("test")
    [parallel] = [c for c in commands if "test-e2e" in c and "test-local" in c]
    assert "-j2" in parallel.split() and "--output-sync=target" in parallel.split()
    # Each test runs in exactly one half: `-m e2e` and `-m "not e2e"` split the suite.
    pytests = [c for c in commands if "-m pytest" in c and ".venv-floor" not in c]
    assert sorted(re.search(r'-m (e2e|"not e2e")', c).group(1) for c in pytests) == ['"not e2e"', "e2e"]


def test_make_test_starts_the_floor_venv_and_cluster_tools_in_the_background_first() -> None:
    commands = _dry_run("test")
    floor_install = _index(commands, r"^\(nice -n 10 flock \.venv-floor\.lock .*pip install.*&\)$")
    tools = _index(commands, r"\(nice -n 10 bash -c .*build-prometheus.*build-kwok.*--volcano.*&\)$")
    assert floor_install < _index(commands, r"-m pytest -m \"not e2e\"")
    assert tools < _index(commands, r"-m pytest -m e2e")
    # test-floor waits for the background install's lock (or installs again) before its tests.
    floor_tests = _index(commands, r"\.venv-floor/bin/python -m pytest")
    waits = [i for i, c in enumerate(commands) if c.startswith("flock .venv-floor.lock")]
    assert waits and waits[0] < floor_tests, commands
