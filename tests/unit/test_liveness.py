"""One liveness model: every timeout inside the pods derives from the heartbeat timeout T
(contract.Liveness), and the coordinator and the agents take theirs from the pod's environment."""

from __future__ import annotations

import socket
import time

import pytest

from dtjob import contract
from dtjob.api.models import ElasticPolicy
from dtjob.launcher import protocol
from dtjob.launcher.agent import AgentSettings
from dtjob.launcher.coordinator import Coordinator, GangState, NoRestart, Restart, TrainerExit, decide
from tests.trainer.runtime_gang import free_port


def test_the_default_timeouts_are_those_of_before() -> None:
    lv = contract.Liveness()
    assert lv.timeout == contract.DEFAULT_HEARTBEAT_TIMEOUT == 10.0
    assert (lv.heartbeat_beat_seconds, lv.heartbeat_verdict_seconds) == (1.0, 12.0)
    assert (lv.agent_beat_seconds, lv.agent_timeout_seconds) == pytest.approx((0.5, 3.0))
    assert (lv.stop_timeout_seconds, lv.answer_timeout_seconds) == (10.0, 15.0)


def test_the_jobs_default_is_the_contracts() -> None:
    assert (
        ElasticPolicy.model_fields["heartbeat_timeout_seconds"].default == contract.DEFAULT_HEARTBEAT_TIMEOUT
    )


@pytest.mark.parametrize("timeout", [1.0, 4.0, 10.0, 60.0, 3600.0])
def test_the_timeouts_keep_their_order_at_any_heartbeat_timeout(timeout: float) -> None:
    lv = contract.Liveness(timeout)
    # A frozen pod's agent is counted out before its peers' heartbeat names its rank lost.
    assert lv.agent_timeout_seconds + lv.agent_beat_seconds < timeout
    # The coordinator's give-up at the stop timeout reaches an agent before its own deadline.
    assert lv.stop_timeout_seconds < lv.answer_timeout_seconds
    assert lv.heartbeat_beat_seconds <= min(lv.HEARTBEAT_MAX_BEAT_SECONDS, timeout / 2)


def test_the_pods_environment_sets_t_and_no_heartbeat_keeps_the_default() -> None:
    assert contract.PodEnv.from_environ({contract.ENV_HEARTBEAT_TIMEOUT: "4"}).liveness == contract.Liveness(
        4.0
    )
    assert contract.PodEnv.from_environ({contract.ENV_HEARTBEAT_TIMEOUT: "0"}).liveness == contract.Liveness()
    assert contract.PodEnv.from_environ({}).liveness == contract.Liveness()
    settings = AgentSettings.from_env({contract.ENV_HEARTBEAT_TIMEOUT: "6"})
    assert settings.liveness.answer_timeout_seconds == 9.0


def test_the_coordinators_decision_takes_the_gangs_timeout() -> None:
    now = 1000.0
    failure = TrainerExit(pod=0, round=0, rank=0, code=1)
    for timeout, decision in [
        (10.0, Restart("rank 0 (pod 0) exited 1")),  # silent 2 s < 3 s
        (4.0, NoRestart("the agent of pod 1 is not answering")),  # silent 2 s > 1.2 s
    ]:
        state = GangState(pods=2, restarts_left=1, liveness=contract.Liveness(timeout))
        state.beats = {0: now, 1: now - 2.0}
        assert decide(state, failure, now) == decision


def _join(sock: socket.socket, pod: int) -> None:
    sock.sendall(protocol.encode(protocol.Hello(pod, "uid-l")) + protocol.encode(protocol.Beat(pod)))
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = sock.recv(1)
        assert chunk, "the coordinator closed the connection"
        answer += chunk
    assert protocol.decode(answer) == protocol.Ack()


def test_a_coordinator_counts_a_pod_out_after_its_own_agent_timeout() -> None:
    """T = 2 s: a pod silent 1 s (> 0.3 T) is out, where the default (3 s) would still wait."""
    coordinator = Coordinator(
        free_port(), pods=2, restarts_left=3, job_uid="uid-l", liveness=contract.Liveness(2.0)
    )
    coordinator.start()
    address = ("127.0.0.1", coordinator.port)
    with (
        socket.create_connection(address, timeout=10) as pod0,
        socket.create_connection(address, timeout=10) as pod1,
    ):
        _join(pod0, 0)
        _join(pod1, 1)
        time.sleep(1.0)  # pod 1 says nothing; pod 0's failure below counts as its own beat
        pod0.sendall(protocol.encode(protocol.Failed(pod=0, round=0, rank=0, code=1)))
        line = pod0.makefile("rb").readline()
    assert protocol.decode(line) == protocol.GiveUp(0, "the agent of pod 1 is not answering")
