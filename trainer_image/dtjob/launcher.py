"""`python -m dtjob.launcher -- CMD ...`: run LOCAL_WORLD_SIZE copies of a trainer command in one pod,
as torchrun's local agent does, with the environment each process needs.

The operator starts a worker pod of `spec.nprocPerWorker` = n processes through this launcher. The
pod's environment names the pod (DTJOB_POD_RANK, DTJOB_PODS) and the gang in processes
(WORLD_SIZE = pods x n, LOCAL_WORLD_SIZE = n); process i gets LOCAL_RANK = i and
RANK = pod rank x n + i. Standard library only: it starts in milliseconds and never imports torch.

Lifecycle (what the operator relies on):
- SIGTERM/SIGINT are passed to every local process: each checkpoints with its gang and exits 75,
  and the pod exits 75 once all did.
- One local process failing (any exit but 0 and 75, or a signal) stops its siblings at once:
  SIGTERM, then SIGKILL after GRACE_SECONDS (a sibling blocked in a collective with the dead one
  would otherwise wait for the collective timeout), and the pod exits with the failed process's
  code (128 + N for signal N, as a shell reports it), so the operator sees the failure in seconds.
- All exiting 0 exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

from dtjob import contract

# A failed process's siblings get this long between SIGTERM and SIGKILL: a healthy one stops at
# once, one blocked in a collective never would.
GRACE_SECONDS = 2.0
_POLL_SECONDS = 0.05


def _code(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def child_env(environ: dict[str, str], local_rank: int) -> dict[str, str]:
    """The environment of local process `local_rank` of this pod."""
    nproc = int(environ.get(contract.ENV_LOCAL_WORLD_SIZE) or 1)
    pod_rank = int(environ.get(contract.ENV_POD_RANK) or environ.get(contract.ENV_RANK) or 0)
    env = dict(environ)
    env[contract.ENV_LOCAL_RANK] = str(local_rank)
    env[contract.ENV_RANK] = str(pod_rank * nproc + local_rank)
    # Several processes share the pod's CPUs: one intra-op thread each unless the user chose.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(command: list[str], environ: dict[str, str]) -> int:
    nproc = int(environ.get(contract.ENV_LOCAL_WORLD_SIZE) or 1)
    if nproc < 1:
        print(f"dtjob-launcher: error: LOCAL_WORLD_SIZE={nproc} must be at least 1", file=sys.stderr)
        return contract.EXIT_CONFIG_ERROR
    children = [subprocess.Popen(command, env=child_env(environ, i)) for i in range(nproc)]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed: int | None = None
    while True:
        codes = [child.poll() for child in children]
        for i, code in enumerate(codes):
            if code is None or failed is not None or _code(code) in (contract.EXIT_OK, contract.EXIT_STOPPED):
                continue
            failed = _code(code)
            print(f"dtjob-launcher: local rank {i} exited {failed}; stopping the others", file=sys.stderr)
            _stop(children)
        if all(code is not None for code in codes):
            break
        time.sleep(_POLL_SECONDS)
    if failed is not None:
        return failed
    statuses = {_code(c.returncode) for c in children}
    return contract.EXIT_STOPPED if contract.EXIT_STOPPED in statuses else contract.EXIT_OK


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(c.poll() is None for c in children):
        time.sleep(_POLL_SECONDS)
    for child in children:
        if child.poll() is None:
            child.kill()
    for child in children:
        child.wait()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m dtjob.launcher -- COMMAND [ARGS...]", file=sys.stderr)
        return contract.EXIT_CONFIG_ERROR
    return launch(args, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
