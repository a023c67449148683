"""The pod's agent: runs the trainer processes, and restarts the gang in place with the others.

`python -m dtjob.launcher -- COMMAND...` (the operator's command for a pod of several processes,
or with restarts in place) runs LOCAL_WORLD_SIZE copies of COMMAND (dtjob.launcher.local) and:

- passes SIGTERM/SIGINT to them: each checkpoints with its gang and exits 75, and so does the pod;
- exits 0 when all exited 0;
- when one fails (any other exit), and DTJOB_AGENT_PORT is set: kills its siblings at once and
  reports the failure to the coordinator (dtjob.launcher.coordinator, served by pod 0's agent).
  When every pod's agent is there and restarts are left (DTJOB_RESTARTS_LEFT), every agent kills
  its trainers and starts the next round's, from the warm standbys, with
  DTJOB_IN_PLACE_RESTARTS = the round and DTJOB_RESTART_CAUSE = what failed. The pods stay.
- otherwise (no agent port, a permanent exit code of DTJOB_PERMANENT_EXIT_CODES, no restarts
  left, a pod missing or being deleted, the coordinator unreachable): stops its siblings (SIGTERM,
  SIGKILL after a grace) and exits with the failed process's status (128 + N for signal N, as a
  shell reports it), after its last line `contract.in_place_line(...)`: the operator then restarts
  the gang in new pods, and reads from that line how many restarts in place it made.

It talks to the coordinator and its standbys in dtjob.launcher.protocol's messages, and takes its
timeouts from the pod's contract.Liveness (DTJOB_HEARTBEAT_TIMEOUT). Standard library only: the
agent starts in milliseconds and never imports torch (its standbys do).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType

from dtjob import contract
from dtjob.launcher import protocol
from dtjob.launcher.coordinator import Coordinator, describe_code
from dtjob.launcher.local import POLL_SECONDS, LocalProcesses

# How often an agent tries to reach the coordinator until it does (pod 0 may start after it).
CONNECT_RETRY_SECONDS = 0.1
NOT_FAILURES = (contract.EXIT_OK, contract.EXIT_STOPPED)  # done, or stopped after a checkpoint
GONE = "the coordinator is gone"  # the reason when the connection to it is lost


@dataclass(frozen=True)
class AgentSettings:
    """What the pod's environment says (dtjob.contract)."""

    nproc: int
    pod: int
    pods: int
    master_addr: str
    agent_port: int | None  # None: no restarts in place
    restarts_left: int
    permanent_codes: frozenset[int]
    job_uid: str = ""  # DTJOB_JOB_UID: which gang an agent's hello is for
    liveness: contract.Liveness = field(default_factory=contract.Liveness)  # DTJOB_HEARTBEAT_TIMEOUT

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> AgentSettings:
        """Raises contract.PodEnvError (a ValueError) naming a malformed variable."""
        env = contract.PodEnv.from_environ(environ)
        return cls(
            nproc=env.local_world_size,
            pod=env.pod_rank,
            pods=env.pods,
            master_addr=env.master_addr,
            agent_port=env.agent_port,
            restarts_left=env.restarts_left,
            permanent_codes=env.permanent_exit_codes,
            job_uid=env.job_uid,
            liveness=env.liveness,
        )


class Link:
    """This agent's connection to the coordinator: connects in the background (until it does),
    beats every `liveness.agent_beat_seconds`, and puts what the coordinator says into `inbox`
    (None when the connection is lost)."""

    def __init__(
        self, host: str, port: int, pod: int, job_uid: str = "", liveness: contract.Liveness | None = None
    ) -> None:
        self.host, self.port, self.pod, self.job_uid = host, port, pod, job_uid
        self.liveness = liveness or contract.Liveness()
        self.inbox: queue.Queue[protocol.CoordinatorMessage | None] = queue.Queue()
        self._sock: socket.socket | None = None
        # Reentrant: the SIGTERM handler sends too, on the main thread, maybe inside a send.
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self.heard_at = float("-inf")  # monotonic time of the coordinator's last message

    @property
    def answering(self) -> bool:
        """Connected, and the coordinator said something (a beat's ack) within the agent timeout
        (contract.Liveness): a frozen pod 0 takes no one's failure for a restart in place."""
        silent = time.monotonic() - self.heard_at
        return self._sock is not None and silent <= self.liveness.agent_timeout_seconds

    def start(self) -> None:
        threading.Thread(target=self._run, name="dtjob-agent-link", daemon=True).start()

    def send(self, message: protocol.AgentMessage) -> bool:
        with self._lock:
            if self._sock is None:
                return False
            try:
                self._sock.sendall(protocol.encode(message))
                return True
            except OSError:
                return False

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()

    def _run(self) -> None:
        sock = None
        while sock is None and not self._closed.is_set():
            try:
                sock = socket.create_connection((self.host, self.port), timeout=1.0)
            except OSError:
                time.sleep(CONNECT_RETRY_SECONDS)
        if sock is None:
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sock = sock
        self.heard_at = time.monotonic()
        self.send(protocol.Hello(self.pod, self.job_uid))
        threading.Thread(target=self._beat, name="dtjob-agent-beat", daemon=True).start()
        try:
            for line in sock.makefile("r", encoding="utf-8"):
                self.heard_at = time.monotonic()
                try:
                    message = protocol.decode(line)
                except protocol.UnknownMessage:  # a newer coordinator's: not for this version
                    continue
                if isinstance(message, protocol.CoordinatorMessage) and not isinstance(message, protocol.Ack):
                    self.inbox.put(message)
        except (OSError, ValueError):  # a malformed line (protocol.ProtocolError): the link is lost
            pass
        with self._lock:
            self._sock = None
        self.inbox.put(None)

    def _beat(self) -> None:
        beat = self.liveness.agent_beat_seconds
        while not self._closed.wait(beat) and self.send(protocol.Beat(self.pod)):
            pass


class Agent:
    def __init__(self, command: Sequence[str], environ: Mapping[str, str], settings: AgentSettings) -> None:
        self.settings = settings
        in_place = settings.agent_port is not None
        self.local = LocalProcesses(command, environ, settings.nproc, warm=in_place)
        self.coordinator: Coordinator | None = None
        self.link: Link | None = None
        if in_place and settings.agent_port is not None:
            if settings.pod == 0:
                try:
                    self.coordinator = Coordinator(
                        settings.agent_port,
                        settings.pods,
                        settings.restarts_left,
                        settings.job_uid,
                        settings.liveness,
                    )
                    self.coordinator.start()
                except OSError as err:  # the trainers still run; their failures go to the operator
                    self._say(
                        f"cannot listen on {contract.ENV_AGENT_PORT}={settings.agent_port}: {err}; "
                        "no restarts in place"
                    )
            host = "127.0.0.1" if settings.pod == 0 else settings.master_addr
            self.link = Link(host, settings.agent_port, settings.pod, settings.job_uid, settings.liveness)
            self.link.start()
        self.round = 0
        self.terminating = False

    # signals -----------------------------------------------------------------------------
    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.terminating and self.link is not None:
            self.link.send(protocol.Terminating(self.settings.pod))
        self.terminating = True
        self.local.signal(signum)

    # the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        self.local.start({})
        try:
            while True:
                code = self._watch()
                if code is not None:
                    return code
        finally:
            self.local.close()
            if self.link is not None:
                self.link.close()

    def _watch(self) -> int | None:
        """One look at the trainers and the coordinator; the pod's exit status when it is done."""
        message = self._next_message(POLL_SECONDS)
        if isinstance(message, protocol.Stop):
            return self._restart(message.round, message.cause)
        if not self.terminating:
            self.local.refill()
        codes = self.local.poll()
        failed = next(((i, c) for i, c in enumerate(codes) if c is not None and c not in NOT_FAILURES), None)
        if failed is not None:
            return self._failed(*failed)
        if all(c is not None for c in codes):
            return contract.EXIT_STOPPED if contract.EXIT_STOPPED in codes else contract.EXIT_OK
        return None

    def _next_message(self, timeout: float) -> protocol.CoordinatorMessage | None:
        """The coordinator's next message within `timeout`, or None; a lost connection reads as
        the coordinator giving up."""
        if self.link is None:
            time.sleep(timeout)
            return None
        try:
            message = self.link.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        return message if message is not None else protocol.GiveUp(self.round, GONE)

    def _failed(self, local_rank: int, code: int) -> int | None:
        """A trainer of this pod failed: restart in place if the coordinator says so, else leave."""
        rank = self.settings.pod * self.settings.nproc + local_rank
        what = f"local rank {local_rank} (rank {rank}) exited {describe_code(code)}"
        reason = self._why_not_in_place(code)
        if reason is None and self.link is not None:
            self.local.kill()  # its peers are lost without it; they must not wait in a collective
            self.link.send(protocol.Failed(self.settings.pod, self.round, rank, code))
            answer_timeout = self.settings.liveness.answer_timeout_seconds
            deadline = time.monotonic() + answer_timeout
            while time.monotonic() < deadline:
                answer = self._next_message(min(0.1, max(0.0, deadline - time.monotonic())))
                if answer is None and not self.link.answering:
                    reason = "the coordinator stopped answering"
                    break
                if answer is None:
                    continue
                if isinstance(answer, protocol.Stop) and answer.round == self.round:
                    return self._restart(self.round, answer.cause)
                if isinstance(answer, protocol.GiveUp):
                    reason = answer.reason
                    break
            else:
                reason = f"no answer from the coordinator within {answer_timeout:g}s"
        self._say(f"{what}; {reason or 'no restarts in place'}: stopping the others")
        self.local.stop()
        return self._leave(code)

    def _why_not_in_place(self, code: int) -> str | None:
        s = self.settings
        if s.agent_port is None:
            return "restarts in place are off"
        if self.terminating:
            return "the pod is being deleted"
        if code in s.permanent_codes:
            return f"exit code {code} is permanent (elastic.permanentExitCodes)"
        if code == contract.EXIT_STALE_GENERATION:
            return "a stale generation is the operator's to replace"
        if self.round >= s.restarts_left:
            return f"no restarts left ({self.round} in place; elastic.maxRestarts)"
        if self.link is None or not self.link.answering:
            return "the coordinator (pod 0's agent) is not answering"
        return None

    def _restart(self, round_: int, cause: str) -> int | None:
        """Kill this round's trainers, tell the coordinator, and start the next round when it says."""
        failed_at = time.time()  # milliseconds after the failure: this pod's or the coordinator's stop
        self.local.kill()
        assert self.link is not None
        self.link.send(protocol.Stopped(self.settings.pod, round_))
        answer_timeout = self.settings.liveness.answer_timeout_seconds
        deadline = time.monotonic() + answer_timeout
        while time.monotonic() < deadline:
            if self.terminating:
                return 128 + signal.SIGTERM
            answer = self._next_message(min(0.1, max(0.0, deadline - time.monotonic())))
            if answer is None and not self.link.answering:
                answer = protocol.GiveUp(round_, "the coordinator stopped answering")
            if answer is None:
                continue
            if isinstance(answer, protocol.Start):
                self.round = answer.round
                cause = answer.cause or cause
                env = {
                    contract.ENV_IN_PLACE_RESTARTS: str(self.round),
                    contract.ENV_RESTART_CAUSE: cause,
                    contract.ENV_RESTART_FAILED_AT: f"{failed_at:.3f}",
                }
                warm = self.local.start(env)
                self._say(
                    f"restart in place {self.round}: {cause} ({warm} of {self.settings.nproc} "
                    "trainers from warm standbys)"
                )
                return None
            if isinstance(answer, protocol.GiveUp):
                self._say(f"the restart in place failed: {answer.reason}")
                return self._leave(contract.EXIT_FAILURE)
        self._say(f"the restart in place failed: no start within {answer_timeout:g}s")
        return self._leave(contract.EXIT_FAILURE)

    def _leave(self, code: int) -> int:
        if self.settings.agent_port is not None:
            self._say(contract.in_place_line(self.round))
        return code

    def _say(self, text: str) -> None:
        print(f"dtjob-launcher[pod {self.settings.pod}]: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m dtjob.launcher -- COMMAND [ARGS...]", file=sys.stderr)
        return contract.EXIT_CONFIG_ERROR
    try:
        settings = AgentSettings.from_env(os.environ)
    except ValueError as err:
        print(f"dtjob-launcher: error: {err}", file=sys.stderr)
        return contract.EXIT_CONFIG_ERROR
    agent = Agent(args, dict(os.environ), settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, agent.on_signal)
    return agent.run()
