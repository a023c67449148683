"""What a client of the devcluster on this machine needs (bench/ and the e2e harness): the admin
kubectl and a free local port for a process it starts."""

from __future__ import annotations

import os
import socket
import subprocess

from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.layout import Layout


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
