"""dtjob.launcher with real child processes (tiny Python scripts, no torch): the per-process
environment, SIGTERM passed to every child (the pod exits 75 once all did), and one failed child
stopping its siblings within seconds with its own exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.trainer.runtime_gang import SOURCE_ROOTS

CHILD = r"""
import os, signal, sys, time
out = sys.argv[1]
# The handler before the file: the test sends SIGTERM once every file exists.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
with open(os.path.join(out, "rank" + os.environ["RANK"]), "w") as f:
    f.write(" ".join(os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")))
mode = sys.argv[2]
if mode == "finish":
    sys.exit(0)
if mode == "die" and os.environ["LOCAL_RANK"] == "1":
    # Dies only once all 3 have started: the launcher stops the others at once, so dying earlier
    # could stop a sibling before it wrote its file.
    while len([n for n in os.listdir(out) if n.startswith("rank")]) < 3:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hang" or mode == "die":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # blocked in a collective: only SIGKILL ends it
while True:
    time.sleep(0.05)
"""


def _launch(tmp_path: Path, mode: str, nproc: int = 3) -> subprocess.Popen[bytes]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, SOURCE_ROOTS)),
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(2 * nproc),
        "RANK": str(nproc),
        "DTJOB_POD_RANK": "1",
    }
    command = [sys.executable, "-m", "dtjob.launcher", "--", sys.executable, str(script), str(tmp_path), mode]
    return subprocess.Popen(command, env=env)


def _wait_for_children(tmp_path: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*"))) < count:
        assert time.monotonic() < deadline, "children did not start"
        time.sleep(0.05)


def test_each_process_gets_its_rank_and_all_exiting_0_exits_0(tmp_path: Path) -> None:
    assert _launch(tmp_path, "finish").wait(timeout=60) == 0
    ranks = sorted((tmp_path / f"rank{r}").read_text() for r in (3, 4, 5))
    assert ranks == ["3 0 3 6", "4 1 3 6", "5 2 3 6"]  # RANK = pod 1 x 3 + LOCAL_RANK


def test_sigterm_reaches_every_process_and_the_pod_exits_75(tmp_path: Path) -> None:
    launcher = _launch(tmp_path, "train")
    _wait_for_children(tmp_path, 3)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 75


def test_a_killed_process_stops_its_siblings_within_seconds_with_its_code(tmp_path: Path) -> None:
    launcher = _launch(tmp_path, "die")
    _wait_for_children(tmp_path, 3)
    # Its siblings ignore SIGTERM (as if blocked in a collective): SIGKILL after the grace period,
    # well inside this bound.
    code = launcher.wait(timeout=30)
    assert code == 128 + signal.SIGKILL  # the killed child's status, as a shell reports it
