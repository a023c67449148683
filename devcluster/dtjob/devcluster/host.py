"""This machine's side of the devcluster: its ports (is one free, pick a free one) and the admin
kubectl that bench/ and the e2e harness run."""

from __future__ import annotations

import os
import socket
import subprocess

from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.layout import Layout


def port_free(port: int, host: str = "0.0.0.0") -> bool:
    """Whether a server could listen on `port` of `host` now (0.0.0.0: on every address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def admin_env() -> dict[str, str]:
    """This process's environment with KUBECONFIG set to the devcluster's admin credentials."""
    return {**os.environ, "KUBECONFIG": str(Layout.from_env().admin_kubeconfig)}


def kubectl(*args: str, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The pinned kubectl as the devcluster's admin; the caller checks the exit code."""
    return subprocess.run(
        [str(Binaries.pinned().path("kubectl")), *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=admin_env(),
        check=False,
    )
