"""The gang's restarts in place: pod 0's agent decides them, every pod's agent carries them out.

Every agent (dtjob.launcher.agent) keeps one TCP connection to the coordinator, which pod 0's
agent serves on DTJOB_AGENT_PORT, and talks in JSON lines:

    agent -> coordinator   {"hello": POD, "job": UID}   {"beat": POD} (answered {"ack": true})
                           {"terminating": POD}
                           {"failed": POD, "round": R, "rank": RANK, "code": CODE}
                           {"stopped": POD, "round": R}
    coordinator -> agent   {"stop": R, "cause": TEXT}      kill your trainers of round R, say stopped
                           {"start": R + 1, "cause": TEXT}  start round R + 1 (from the standbys)
                           {"give_up": R, "reason": TEXT}  no restart in place: leave failing

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

import json
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("dtjob.launcher")

# Agents beat this often; one silent for BEAT_TIMEOUT_SECONDS is taken for gone (a whole pod
# frozen, its network cut): no restart in place waits for it.
BEAT_SECONDS = 0.5
BEAT_TIMEOUT_SECONDS = 3.0
# Every agent must have stopped its trainers this soon after the stop (SIGKILL and reaping take
# milliseconds; a process stuck in the kernel may never go): past it the coordinator gives up.
STOP_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class Failure:
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
class GiveUp:
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


def decide(state: GangState, failure: Failure, now: float) -> Restart | GiveUp | Ignore:
    """Restart the gang in place after `failure`, give up on that, or ignore it. Pure."""
    if failure.round != state.round or state.restarting:
        return Ignore()
    if state.given_up:
        return GiveUp("an earlier restart in place failed")
    if state.terminating:
        return GiveUp(f"pod {min(state.terminating)} is being deleted")
    if state.round >= state.restarts_left:
        return GiveUp(f"no restarts left ({state.round} in place; elastic.maxRestarts)")
    missing = [p for p in range(state.pods) if now - state.beats.get(p, float("-inf")) > BEAT_TIMEOUT_SECONDS]
    if missing:
        return GiveUp(f"the agent of pod {missing[0]} is not answering")
    return Restart(failure.describe())


class Coordinator:
    """The TCP server in pod 0's agent (see the module docstring)."""

    def __init__(self, port: int, pods: int, restarts_left: int, job_uid: str = "") -> None:
        self.state = GangState(pods, restarts_left)
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
                message = json.loads(line)
                if "hello" in message:
                    if message.get("job", "") != self.job_uid:
                        log.warning("dtjob-coordinator: refused an agent of job uid %r", message.get("job"))
                        return
                    pod = int(message["hello"])
                    with self._lock:
                        self._conns[pod] = conn
                elif pod is None:
                    return  # not an agent of this gang: it said no hello first
                self._handle(message)
        except (OSError, ValueError) as err:
            log.debug("coordinator: connection of pod %s: %s", pod, err)
        finally:
            with self._lock:
                if pod is not None and self._conns.get(pod) is conn:
                    del self._conns[pod]
                    self.state.beats.pop(pod, None)
                    if self.state.restarting and pod not in self._stopped:
                        self._give_up(f"the agent of pod {pod} left during the restart in place")
            conn.close()

    def _handle(self, message: dict[str, object]) -> None:
        now = time.monotonic()
        with self._lock:
            for key in ("hello", "beat", "terminating", "failed", "stopped"):
                if key in message:
                    self.state.beats[int(str(message[key]))] = now
            if "beat" in message:  # the agent knows the coordinator is there from the answer
                self._send(int(str(message["beat"])), {"ack": True})
            if "terminating" in message:
                self.state.terminating.add(int(str(message["terminating"])))
            if "failed" in message:
                failure = Failure(
                    int(str(message["failed"])), int(str(message["round"])),
                    int(str(message["rank"])), int(str(message["code"])),
                )  # fmt: skip
                self._failed(failure, now)
            if "stopped" in message and int(str(message["round"])) == self.state.round:
                self._stopped.add(int(str(message["stopped"])))
                if self.state.restarting and len(self._stopped) == self.state.pods:
                    self.state.round += 1
                    self.state.restarting = False
                    log.warning("dtjob-coordinator: round %d starts: %s", self.state.round, self._cause)
                    self._broadcast({"start": self.state.round, "cause": self._cause})

    def _failed(self, failure: Failure, now: float) -> None:
        decision = decide(self.state, failure, now)
        if isinstance(decision, Ignore):
            return
        if isinstance(decision, GiveUp):
            self._send(failure.pod, {"give_up": failure.round, "reason": decision.reason})
            return
        self.state.restarting = True
        self._cause = decision.cause
        self._stopped = set()
        log.warning("dtjob-coordinator: %s; restarting the gang in place", decision.cause)
        self._broadcast({"stop": self.state.round, "cause": decision.cause})
        round_ = self.state.round
        timer = threading.Timer(STOP_TIMEOUT_SECONDS, self._stop_timed_out, args=(round_,))
        timer.daemon = True
        timer.start()

    def _stop_timed_out(self, round_: int) -> None:
        with self._lock:
            if not self.state.restarting or self.state.round != round_:
                return
            late = sorted(set(range(self.state.pods)) - self._stopped)
            self._give_up(f"pod {late[0]} did not stop its trainers within {STOP_TIMEOUT_SECONDS:g}s")

    def _give_up(self, reason: str) -> None:
        """The restart in place under way cannot complete: every agent leaves failing, and the
        operator restarts the gang in new pods."""
        self.state.given_up = True
        self.state.restarting = False
        log.warning("dtjob-coordinator: %s; giving up the restart in place", reason)
        self._broadcast({"give_up": self.state.round, "reason": reason})

    def _broadcast(self, message: dict[str, object]) -> None:
        for pod in list(self._conns):
            self._send(pod, message)

    def _send(self, pod: int, message: dict[str, object]) -> None:
        conn = self._conns.get(pod)
        if conn is None:
            return
        try:
            conn.sendall((json.dumps(message) + "\n").encode())
        except OSError as err:
            log.debug("coordinator: cannot reach pod %d: %s", pod, err)
