"""The trainer processes of one pod: LOCAL_WORLD_SIZE copies of the trainer's command, each with
its environment, and behind each a warm standby (dtjob.launcher.standby) when restarts in place
are on and the command is one a standby can run.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from dtjob import contract
from dtjob.launcher import protocol, standby

# A failed process's siblings get this long between SIGTERM and SIGKILL when the pod gives up: a
# healthy one stops at once, one blocked in a collective never would.
GRACE_SECONDS = 2.0
POLL_SECONDS = 0.02
# A round's standbys start this long after its trainers: a trainer imports torch and torch._dynamo
# in 4 s on this 2-core machine, and a standby importing beside it from the start left it no core
# when a restart in place found no standby ready (12 s to the next step instead of 5).
STANDBY_DELAY_SECONDS = 5.0


def exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def child_env(environ: Mapping[str, str], local_rank: int) -> dict[str, str]:
    """The environment of local process `local_rank` of this pod."""
    pod = contract.PodEnv.from_environ(environ)
    env = dict(environ)
    env[contract.ENV_LOCAL_RANK] = str(local_rank)
    env[contract.ENV_RANK] = str(pod.pod_rank * pod.local_world_size + local_rank)
    if pod.local_world_size > 1:
        # Several processes share the pod's CPUs: one intra-op thread each unless the user chose.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class Standby:
    """One warm standby process (see dtjob.launcher.standby), ready once it has imported torch."""

    def __init__(self, target: standby.PythonCommand, command: Sequence[str], env: Mapping[str, str]) -> None:
        ready_r, ready_w = os.pipe()
        # SPT_NOENV: its new process title must not overwrite /proc/PID/environ.
        self.proc = subprocess.Popen(
            [target.interpreter, "-m", "dtjob.launcher.standby", f"--ready-fd={ready_w}", "--", *command],
            env={**env, "SPT_NOENV": "1"},
            stdin=subprocess.PIPE,
            pass_fds=(ready_w,),
        )
        os.close(ready_w)
        self._ready_fd: int | None = ready_r
        self._ready = False

    def ready(self) -> bool:
        """Whether it has imported everything and waits (never blocks)."""
        if self._ready or self._ready_fd is None:
            return self._ready
        if select.select([self._ready_fd], [], [], 0)[0]:
            self._ready = os.read(self._ready_fd, 1) == b"1"
            os.close(self._ready_fd)
            self._ready_fd = None
        return self._ready

    def activate(self, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """Make it the trainer, with these variables added to its environment."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(protocol.encode(protocol.Activate(dict(env))))
        self.proc.stdin.close()
        return self.proc

    def discard(self) -> None:
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        self.proc.kill()
        self.proc.wait()


class LocalProcesses:
    """The pod's trainer processes of the current round, and their standbys."""

    def __init__(self, command: Sequence[str], environ: Mapping[str, str], nproc: int, warm: bool) -> None:
        self.command = list(command)
        self.environ = dict(environ)
        self.nproc = nproc
        self.target = standby.parse(command) if warm else None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.standbys: list[Standby | None] = [None] * nproc
        self.started_at = 0.0  # monotonic: when the round's trainers started

    def start(self, round_env: Mapping[str, str]) -> int:
        """Start the round's trainers: from ready standbys, else new interpreters (`refill` puts
        new standbys behind them later). Returns how many came from standbys."""
        self.procs = []
        warm = 0
        for i in range(self.nproc):
            spare = self.standbys[i]
            self.standbys[i] = None
            if spare is not None and spare.ready() and spare.proc.poll() is None:
                try:
                    self.procs.append(spare.activate(round_env))
                    warm += 1
                    continue
                except OSError:  # it died just now: a new interpreter instead
                    pass
            if spare is not None:
                spare.discard()  # still importing: a new interpreter is as fast, at full priority
            self.procs.append(subprocess.Popen(self.command, env={**child_env(self.environ, i), **round_env}))
        self.started_at = time.monotonic()
        return warm

    def refill(self) -> None:
        """A standby behind every local rank that lacks one (or whose standby died), once the
        round's trainers have had STANDBY_DELAY_SECONDS to start."""
        if self.target is None or time.monotonic() - self.started_at < STANDBY_DELAY_SECONDS:
            return
        for i, spare in enumerate(self.standbys):
            if spare is not None and spare.proc.poll() is None:
                continue
            try:
                self.standbys[i] = Standby(self.target, self.command, child_env(self.environ, i))
            except OSError as err:  # not fatal: the next round starts a new interpreter
                print(f"dtjob-launcher: no standby for local rank {i}: {err}", file=sys.stderr, flush=True)
                self.target = None
                return

    def poll(self) -> list[int | None]:
        """Each trainer's exit status as a shell reports it, None while it runs."""
        return [None if (code := p.poll()) is None else exit_status(code) for p in self.procs]

    def signal(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL every trainer and wait until all are gone (their gang is lost anyway)."""
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after GRACE_SECONDS, and wait for every trainer."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_SECONDS)
        self.kill()

    def close(self) -> None:
        """Discard the standbys (the pod is done)."""
        for i, spare in enumerate(self.standbys):
            if spare is not None:
                spare.discard()
            self.standbys[i] = None
