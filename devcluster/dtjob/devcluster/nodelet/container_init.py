"""Runs inside a pod's namespaces (see sandbox.launch_argv) and becomes the container's process.

    python -I -S container_init.py PLAN.json

PLAN: {"hostname", "mounts": [{"source", "target", "readOnly"}], "keep": [...], "env": {...},
"workingDir", "runAsUser", "runAsGroup", "supplementalGroups", "argv": [...]}. It sets the
hostname, bind-mounts every volume at its mountPath (this mount namespace is private, so nothing
shows on the host), drops to the requested user and group, and execs argv. Standard library only:
it must start fast.

A volume may be mounted over a directory that holds what the pod needs: an emptyDir at /tmp hides
a checkout (and its venv) under /tmp, and the nodelet's own state dir with the other volumes'
sources. So every source is opened before the first mount and mounted through its descriptor, and
each "keep" path (the checkout, the Python installation) that a mount hid is bind-mounted back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import socket
import sys
from typing import Any

MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def bind_mount(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    elif not os.path.exists(target):
        # A file mounted at a path that does not exist yet needs a file to mount over.
        os.makedirs(os.path.dirname(target) or "/", exist_ok=True)
        open(target, "a").close()
    if _libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bind-mounting {source} at {target}: {os.strerror(err)}")
    if read_only:
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        if _libc.mount(b"none", target.encode(), None, flags, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"making {target} read-only: {os.strerror(err)}")


def _open_path(path: str) -> int:
    return os.open(path, os.O_PATH | os.O_CLOEXEC)


def _same_file(path: str, fd: int) -> bool:
    try:
        st, want = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino)


def run(plan: dict[str, Any]) -> None:
    socket.sethostname(plan["hostname"])
    mounts = plan.get("mounts", [])
    # Opened before any mount can hide them; /proc/self/fd/N names the opened file itself.
    sources = [_open_path(m["source"]) for m in mounts]
    keep = [(path, _open_path(path)) for path in plan.get("keep", []) if os.path.exists(path)]
    for m, fd in zip(mounts, sources, strict=True):
        bind_mount(f"/proc/self/fd/{fd}", m["target"], bool(m.get("readOnly")))
    for path, fd in keep:
        if not _same_file(path, fd):
            bind_mount(f"/proc/self/fd/{fd}", path, read_only=False)
    workdir = plan.get("workingDir") or "/"
    os.makedirs(workdir, exist_ok=True)
    gid, uid = plan.get("runAsGroup"), plan.get("runAsUser")
    if uid is not None or gid is not None:
        os.setgroups([int(g) for g in plan.get("supplementalGroups") or []])
        os.setgid(int(gid if gid is not None else (uid or 0)))
    if uid is not None:
        os.setuid(int(uid))
    os.chdir(workdir)
    argv = plan["argv"]
    os.execvpe(argv[0], argv, plan["env"])


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    try:
        run(plan)
    except OSError as e:
        print(f"dtjob nodelet: starting {plan['argv']!r} failed: {e}", file=sys.stderr, flush=True)
        # The shell's codes: 127 command not found, 126 not executable; 128 anything else.
        sys.exit(127 if isinstance(e, FileNotFoundError) else 126 if isinstance(e, PermissionError) else 128)


if __name__ == "__main__":
    main()
