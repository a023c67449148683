"""Background processes of the devcluster: start detached, record pids, check, stop.

A pid file alone could point at an unrelated process after a reboot or pid reuse, so a pid only
counts as ours when its command line mentions the cluster's state directory (every component gets
a path inside it as an argument).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

# SIGTERM first so etcd and the API server shut down cleanly; this is how long they get.
STOP_GRACE_SECONDS = 10.0


def start(argv: Sequence[str], log: Path, pid_file: Path, env: Mapping[str, str] | None = None) -> int:
    """Starts argv in its own session (so it outlives the caller and a terminal's ^C), stdout and
    stderr appended to `log`, and writes its pid to `pid_file`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            close_fds=True,
        )
    pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


def cmdline(pid: int) -> str:
    """The process's command line with NULs as spaces ('' when it is gone or unreadable)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def is_running(pid: int) -> bool:
    """True for a live process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may itself contain ')'.
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in {"Z", "X"}


def read_pid(pid_file: Path, marker: str) -> int | None:
    """The pid recorded in pid_file if that process is alive and its command line contains marker."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if is_running(pid) and marker in cmdline(pid):
        return pid
    return None


def _signal_group(pid: int, sig: int) -> None:
    """Signals the process's whole group (it is a session leader, so its children are in it)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def wait_gone(pids: Sequence[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(is_running(p) for p in pids):
            return True
        time.sleep(0.1)
    return not any(is_running(p) for p in pids)


def stop(pid: int, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM, up to `grace` seconds, then SIGKILL; returns once the process is gone."""
    _signal_group(pid, signal.SIGTERM)
    if not wait_gone([pid], grace):
        _signal_group(pid, signal.SIGKILL)
        wait_gone([pid], 5.0)


def kill(pid: int) -> None:
    """SIGKILL at once (how a node is lost), then wait for the process to disappear."""
    _signal_group(pid, signal.SIGKILL)
    wait_gone([pid], 5.0)


def find_by_marker(marker: str) -> Iterator[int]:
    """Pids of live processes (other than this one) whose command line contains marker."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            pid = int(entry.name)
            if marker in cmdline(pid) and is_running(pid):
                yield pid
