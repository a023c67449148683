"""Removing everything a node's pods left behind: processes, network namespaces, veths and
/etc/netns entries. Works from the records in the state directory alone, so it also works after the
nodelet was SIGKILLed (`dtjob devcluster node stop`, `down`) and when a nodelet starts again.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from pathlib import Path

from dtjob.devcluster.nodelet import sandbox
from dtjob.devcluster.nodelet.state import NodeState, process_start_time

log = logging.getLogger(__name__)

# How long killed processes get to disappear before their namespaces are removed anyway.
KILL_WAIT_S = 5.0


def kill_process_group(pid: int, start: int | None, sig: int) -> bool:
    """Signals the process group led by `pid` if that process is still the one recorded."""
    if process_start_time(pid) != start:
        return False
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_node(state_dir: Path) -> None:
    """Kills all of this node's pod processes and deletes their netns, veths, /etc/netns dirs and
    pod directories and logs (their pods can no longer be asked for them). Idempotent."""
    state = NodeState(Path(state_dir))
    procs = state.recorded_processes()
    for pid, start in procs:
        kill_process_group(pid, start, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline and any(process_start_time(p) == s for p, s in procs):
        time.sleep(0.05)
    for box in state.recorded_sandboxes():
        sandbox.teardown(box["netns"], box["veth"])
    for d in (state.pods, state.logs):
        shutil.rmtree(d, ignore_errors=True)
