"""The gang's restarts in place: pod 0's agent decides them, every pod's agent carries them out.

Every agent (dtjob.launcher.agent) keeps one TCP connection to the coordinator, which pod 0's
agent serves on DTJOB_AGENT_PORT, and talks in the JSON lines of dtjob.launcher.protocol: Hello,
Beat (answered Ack), Terminating, Failed and Stopped to it; Stop (kill your trainers of round R,
say Stopped), Start (round R + 1, from the standbys) and GiveUp (leave failing) from it.

A trainer failing in round R is reported; `decide` restarts the gang in place when every pod's
agent is there and beating, none is terminating, and restarts are left. Then the coordinator asks
every agent to stop its trainers, waits until all said they did (so no trainer of round R is alive
anywhere when one of round R + 1 starts: they share MASTER_PORT and the checkpoint directory), and
starts round R + 1 everywhere. Otherwise it gives up, and the failure goes to the operator as
before: the pod fails and the operator restarts the gang in new pods.

An agent says its job's uid (DTJOB_JOB_UID) in its hello, and the coordinator drops a connection
that says another, or anything before a hello: a pod of another job that reaches the port cannot
join the gang by mistake. Not a secret against whoever can read the job (as with torch's TCPStore
on MASTER_PORT, the pod network is trusted).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from dtjob import contract
from dtjob.launcher import protocol

log = logging.getLogger("dtjob.launcher")

# The gang's timeouts are its contract.Liveness (from DTJOB_HEARTBEAT_TIMEOUT); at the default: an
# agent silent BEAT_TIMEOUT_SECONDS is taken for gone (a whole pod frozen, its network cut), and
# every agent must have stopped its trainers STOP_TIMEOUT_SECONDS after a stop.
BEAT_TIMEOUT_SECONDS = contract.Liveness().agent_timeout_seconds
STOP_TIMEOUT_SECONDS = contract.Liveness().stop_timeout_seconds


@dataclass(frozen=True)
class TrainerExit:
    """A trainer process that failed: its pod, the round it ran in, its global rank, exit code."""

    pod: int
    round: int
    rank: int
    code: int

    def describe(self) -> str:
        return f"rank {self.rank} (pod {self.pod}) exited {describe_code(self.code)}"


def describe_code(code: int) -> str:
    """An exit status as a shell reports it, with the signal's name above 128 ("137 (SIGKILL)")."""
    if code > 128:
        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return str(code)


@dataclass(frozen=True)
class Restart:
    cause: str


@dataclass(frozen=True)
class NoRestart:
    """No restart in place (the coordinator answers the failing pod with protocol.GiveUp)."""

    reason: str


@dataclass(frozen=True)
class Ignore:
    """A failure of a round already being replaced (the trainers the stop killed, their peers)."""


@dataclass
class GangState:
    """What the coordinator knows: the round, which pods are there, what it is doing."""

    pods: int
    restarts_left: int
    round: int = 0
    restarting: bool = False
    given_up: bool = False
    beats: dict[int, float] = field(default_factory=dict)  # pod -> last message (monotonic)
    terminating: set[int] = field(default_factory=set)
    liveness: contract.Liveness = field(default_factory=contract.Liveness)


def decide(state: GangState, failure: TrainerExit, now: float) -> Restart | NoRestart | Ignore:
    """Restart the gang in place after `failure`, give up on that, or ignore it. Pure."""
    if failure.round != state.round or state.restarting:
        return Ignore()
    if state.given_up:
        return NoRestart("an earlier restart in place failed")
    if state.terminating:
        return NoRestart(f"pod {min(state.terminating)} is being deleted")
    if state.round >= state.restarts_left:
        return NoRestart(f"no restarts left ({state.round} in place; elastic.maxRestarts)")
    timeout = state.liveness.agent_timeout_seconds
    missing = [p for p in range(state.pods) if now - state.beats.get(p, float("-inf")) > timeout]
    if missing:
        return NoRestart(f"the agent of pod {missing[0]} is not answering")
    return Restart(failure.describe())


class Coordinator:
    """The TCP server in pod 0's agent (see the module docstring)."""

    def __init__(
        self,
        port: int,
        pods: int,
        restarts_left: int,
        job_uid: str = "",
        liveness: contract.Liveness | None = None,
    ) -> None:
        self.state = GangState(pods, restarts_left, liveness=liveness or contract.Liveness())
        self.job_uid = job_uid
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}
        self._stopped: set[int] = set()
        self._cause = ""
        self._server = socket.create_server(("", port), reuse_port=False, backlog=max(16, pods))
        self.port = self._server.getsockname()[1]

    def start(self) -> None:
        threading.Thread(target=self._accept, name="dtjob-coordinator", daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self._server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pod: int | None = None
        try:
            for line in conn.makefile("r", encoding="utf-8"):
                try:
                    message = protocol.decode(line)
                except protocol.UnknownMessage as err:  # a newer agent's: not for this version
                    if pod is None:
                        return  # not an agent of this gang: it said no hello first
                    log.debug("coordinator: pod %s: %s", pod, err)
                    continue
                if isinstance(message, protocol.Hello):
                    if message.job != self.job_uid:
                        log.warning("dtjob-coordinator: refused an agent of job uid %r", message.job)
                        return
                    pod = message.pod
                    with self._lock:
                        self._conns[pod] = conn
                elif pod is None:
                    return  # not an agent of this gang: it said no hello first
                self._handle(message)
        except (OSError, ValueError) as err:  # a malformed line (protocol.ProtocolError) included
            log.debug("coordinator: connection of pod %s: %s", pod, err)
        finally:
            with self._lock:
                if pod is not None and self._conns.get(pod) is conn:
                    del self._conns[pod]
                    self.state.beats.pop(pod, None)
                    if self.state.restarting and pod not in self._stopped:
                        self._give_up(f"the agent of pod {pod} left during the restart in place")
            conn.close()

    def _handle(self, message: protocol.Message) -> None:
        if not isinstance(message, protocol.AgentMessage):
            return  # the coordinator's own kinds (an echo): nothing for it to do
        now = time.monotonic()
        with self._lock:
            self.state.beats[message.pod] = now
            if isinstance(message, protocol.Beat):  # the agent knows the coordinator is there from the answer
                self._send(message.pod, protocol.Ack())
            elif isinstance(message, protocol.Terminating):
                self.state.terminating.add(message.pod)
            elif isinstance(message, protocol.Failed):
                self._failed(TrainerExit(message.pod, message.round, message.rank, message.code), now)
            elif isinstance(message, protocol.Stopped) and message.round == self.state.round:
                self._stopped.add(message.pod)
                if self.state.restarting and len(self._stopped) == self.state.pods:
                    self.state.round += 1
                    self.state.restarting = False
                    log.warning("dtjob-coordinator: round %d starts: %s", self.state.round, self._cause)
                    self._broadcast(protocol.Start(self.state.round, self._cause))

    def _failed(self, failure: TrainerExit, now: float) -> None:
        decision = decide(self.state, failure, now)
        if isinstance(decision, Ignore):
            return
        if isinstance(decision, NoRestart):
            self._send(failure.pod, protocol.GiveUp(failure.round, decision.reason))
            return
        self.state.restarting = True
        self._cause = decision.cause
        self._stopped = set()
        log.warning("dtjob-coordinator: %s; restarting the gang in place", decision.cause)
        self._broadcast(protocol.Stop(self.state.round, decision.cause))
        stop_timeout = self.state.liveness.stop_timeout_seconds
        timer = threading.Timer(stop_timeout, self._stop_timed_out, args=(self.state.round,))
        timer.daemon = True
        timer.start()

    def _stop_timed_out(self, round_: int) -> None:
        with self._lock:
            if not self.state.restarting or self.state.round != round_:
                return
            late = sorted(set(range(self.state.pods)) - self._stopped)
            timeout = self.state.liveness.stop_timeout_seconds
            self._give_up(f"pod {late[0]} did not stop its trainers within {timeout:g}s")

    def _give_up(self, reason: str) -> None:
        """The restart in place under way cannot complete: every agent leaves failing, and the
        operator restarts the gang in new pods."""
        self.state.given_up = True
        self.state.restarting = False
        log.warning("dtjob-coordinator: %s; giving up the restart in place", reason)
        self._broadcast(protocol.GiveUp(self.state.round, reason))

    def _broadcast(self, message: protocol.CoordinatorMessage) -> None:
        for pod in list(self._conns):
            self._send(pod, message)

    def _send(self, pod: int, message: protocol.CoordinatorMessage) -> None:
        conn = self._conns.get(pod)
        if conn is None:
            return
        try:
            conn.sendall(protocol.encode(message))
        except OSError as err:
            log.debug("coordinator: cannot reach pod %d: %s", pod, err)
