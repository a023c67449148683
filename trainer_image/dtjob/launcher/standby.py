"""A warm standby: a Python process that imported torch ahead of time and becomes a trainer
process when its agent says so, running the trainer's command in-process.

    python -m dtjob.launcher.standby --ready-fd=FD -- python [-u] -m MODULE ARGS...
    python -m dtjob.launcher.standby --ready-fd=FD -- python [-u] SCRIPT ARGS...

A restarted trainer in a new interpreter spends most of its restart importing: `import torch`
(2.0 s on the 2-core machine of bench/README.md) and `torch._dynamo`, which every torch optimizer
imports on its first `add_param_group` (1.8 s). A standby has done both before it is needed:

1. It imports PRELOAD (or DTJOB_PRELOAD) on a thread of nice PRELOAD_NICE, so on a busy pod it
   takes little CPU from the trainer it stands behind (nice is per thread on Linux; the main
   thread, which later runs the trainer, stays at the pod's priority: an unprivileged process could
   never lower it again). A standby not ready when a restart comes is not used: a new interpreter
   at the pod's priority starts sooner than one importing at nice 10.
2. It writes one byte to FD and shows `(ready)` in its process title, then waits for one line on
   stdin: dtjob.launcher.protocol.Activate, the variables of its round
   (dtjob.contract.ENV_IN_PLACE_RESTARTS, ...). End of file: the agent no longer needs it, and it
   exits 0.
3. It sets them, takes the command line of the trainer as its process title (so `ps`, and the
   tools that find trainers by their command line, see the trainer), and runs MODULE or SCRIPT
   as `__main__` with runpy: the trainer's own exit status is the process's.

It dies with its agent (PR_SET_PDEATHSIG): a standby or trainer never outlives the pod's agent.
Commands other than `python [-u] -m MODULE` or `python [-u] SCRIPT` get no standby (`parse`).
"""

from __future__ import annotations

import ctypes
import importlib
import io
import os
import re
import runpy
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dtjob.launcher import protocol

# What a standby imports before it is needed: torch, and torch._dynamo (every optimizer's first
# add_param_group imports it: 1.8 s of a 4.3 s restart measured here). DTJOB_PRELOAD (a comma
# list) replaces it: a trainer that imports transformers at start names it there too.
PRELOAD = ("torch", "torch._dynamo")
ENV_PRELOAD = "DTJOB_PRELOAD"
# The standby's import thread: a CFS weight of 110 against a trainer's 1024, about a tenth of a
# core the trainer keeps busy. At nice 19 (weight 15) a standby on this 2-core machine under load
# 6 took 25 s to get ready, and the chaos suite's faults met cold standbys; at 10 the 4 CPU-seconds
# of the import come within ~40 s even beside a trainer using every core.
PRELOAD_NICE = 10
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class PythonCommand:
    """What a standby runs in-process: `module` (python -m) or `script`, with `args`."""

    interpreter: str
    module: str | None
    script: str | None
    args: tuple[str, ...]
    unbuffered: bool = False


def parse(command: Sequence[str]) -> PythonCommand | None:
    """The in-process form of `command`; None when it is not `python [-u] -m MODULE ...` or
    `python [-u] SCRIPT ...` (other interpreter options, another program: no standby)."""
    if not command or not _PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    unbuffered = False
    i = 1
    while i < len(command) and command[i] == "-u":
        unbuffered, i = True, i + 1
    if i >= len(command):
        return None
    if command[i] == "-m":
        if i + 1 >= len(command):
            return None
        return PythonCommand(command[0], command[i + 1], None, tuple(command[i + 2 :]), unbuffered)
    if command[i].startswith("-"):
        return None
    return PythonCommand(command[0], None, command[i], tuple(command[i + 1 :]), unbuffered)


def _die_with_parent() -> None:
    """SIGKILL when the agent dies (Linux; elsewhere the agent's pipes closing stop a standby)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the agent died before the prctl
        os._exit(1)


def preload_modules(environ: Mapping[str, str]) -> tuple[str, ...]:
    raw = environ.get(ENV_PRELOAD)
    return PRELOAD if raw is None else tuple(m.strip() for m in raw.split(",") if m.strip())


def _preload(modules: Sequence[str]) -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PRELOAD_NICE)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:  # not fatal: the trainer imports what it needs itself
            print(f"dtjob-standby: cannot preload {name}: {err}", file=sys.stderr, flush=True)


def _retitle(words: Sequence[str]) -> None:
    """A new command line for `ps` (setproctitle; with SPT_NOENV, which the agent sets,
    /proc/PID/environ stays readable and a title is cut at the length of the standby's own command
    line, which is longer than both titles it takes)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(words))


def run(target: PythonCommand) -> None:
    """Run the target as `__main__` (its SystemExit, if any, propagates)."""
    if target.unbuffered:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(write_through=True)
    if target.module is not None:
        sys.argv = [target.module, *target.args]  # runpy puts the module's file in argv[0]
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
        return
    assert target.script is not None
    sys.argv = [target.script, *target.args]
    sys.path[0] = os.path.dirname(os.path.abspath(target.script))  # as `python SCRIPT` does
    runpy.run_path(target.script, run_name="__main__")


def main(argv: Sequence[str]) -> int:
    if len(argv) < 3 or not argv[0].startswith("--ready-fd=") or argv[1] != "--":
        print("usage: python -m dtjob.launcher.standby --ready-fd=FD -- COMMAND...", file=sys.stderr)
        return 2
    ready_fd, command = int(argv[0].split("=", 1)[1]), list(argv[2:])
    target = parse(command)
    if target is None:
        print(f"dtjob-standby: cannot run {command[:3]} in-process", file=sys.stderr)
        return 2
    _die_with_parent()
    loader = threading.Thread(target=_preload, args=(preload_modules(os.environ),), name="dtjob-preload")
    loader.start()
    loader.join()
    os.write(ready_fd, b"1")
    os.close(ready_fd)
    _retitle([sys.executable, "-m", "dtjob.launcher.standby", "(ready)", "--", *command])
    line = sys.stdin.readline()
    if not line:
        return 0
    activate = protocol.decode(line)
    if not isinstance(activate, protocol.Activate):
        raise protocol.ProtocolError(f"a standby is activated by an Activate message, not {activate}")
    os.environ.update(activate.env)
    devnull = os.open(os.devnull, os.O_RDONLY)  # the trainer's stdin: not the agent's pipe
    os.dup2(devnull, 0)
    os.close(devnull)
    _retitle(command)
    run(target)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
