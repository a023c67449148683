"""Restarts in place with real processes: two pod agents (`python -m dtjob.launcher`) on this
machine, as the operator runs them with spec.elastic.restartInPlace, over tiny Python trainers
(no torch). A trainer that dies restarts the whole gang inside the same agents, from their warm
standbys; without every pod, restarts left or a restartable exit code, the pod fails as before."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtjob import contract
from dtjob.launcher.coordinator import STOP_TIMEOUT_SECONDS, Coordinator
from tests.trainer.runtime_gang import SOURCE_ROOTS, free_port

pytestmark = pytest.mark.slow

# One record per trainer process and round; round 0 dies as `mode` says, later rounds exit 0.
TRAINER = r"""
import json, os, signal, sys, time
out, mode = sys.argv[1], sys.argv[2]
rank, rnd = os.environ["RANK"], int(os.environ.get("DTJOB_IN_PLACE_RESTARTS", "0"))
record = {"rank": int(rank), "round": rnd, "pid": os.getpid(), "cause": os.environ.get("DTJOB_RESTART_CAUSE"),
          "warm": "xml.dom.minidom" in sys.modules}
with open(os.path.join(out, f"rank{rank}-round{rnd}.json"), "w") as f:
    json.dump(record, f)
def wait_for(names):
    while not all(os.path.exists(os.path.join(out, n)) for n in names):
        time.sleep(0.02)
if mode == "exit2" and rank == "1":
    sys.exit(2)
dies = mode == "always" or (mode == "kill" and rnd == 0)
if dies and rank == "1":
    # Dies once both trainers of the round run and both standbys are ready (their preload wrote
    # ready-<rank>-<round>): what a restart in place meets in a real gang.
    wait_for([f"rank0-round{rnd}.json", f"ready-0-{rnd}", f"ready-1-{rnd}"])
    os.kill(os.getpid(), signal.SIGKILL)
if dies or mode in ("sigterm", "exit2"):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
    while True:  # blocked in a collective with rank 1, as far as it knows
        time.sleep(0.05)
wait_for([f"rank0-round{rnd}.json", f"rank1-round{rnd}.json"])
"""

# Preloaded by every standby after xml.dom.minidom: says the standby is ready (per round).
MARKER = r"""
import os
out = os.environ["TEST_OUT"]
n = len([f for f in os.listdir(out) if f.startswith(f"ready-{os.environ['RANK']}-")])
open(os.path.join(out, f"ready-{os.environ['RANK']}-{n}"), "w").close()
"""


@pytest.fixture(autouse=True)
def _no_process_left() -> Iterator[None]:
    """Every agent runs in a session of its own; whatever a test leaves (a failed assertion before
    its agents exit) is killed with its trainers and standbys."""
    yield
    for agent in _STARTED:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
    _STARTED.clear()


_STARTED: list[subprocess.Popen[str]] = []


def _agents(
    tmp_path: Path,
    mode: str,
    *,
    pods: tuple[int, ...] = (0, 1),
    restarts_left: int = 3,
    permanent: str = "2",
    port: int | None = None,
) -> dict[int, subprocess.Popen[str]]:
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "standby_marker.py").write_text(MARKER)
    port = port or free_port()
    agents = {}
    for pod in pods:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*map(str, SOURCE_ROOTS), str(tmp_path)]),
            "TEST_OUT": str(tmp_path),
            "DTJOB_PRELOAD": "xml.dom.minidom,standby_marker",
            contract.ENV_MASTER_ADDR: "127.0.0.1",
            contract.ENV_WORLD_SIZE: "2",
            contract.ENV_RANK: str(pod),
            contract.ENV_LOCAL_WORLD_SIZE: "1",
            contract.ENV_POD_RANK: str(pod),
            contract.ENV_PODS: "2",
            contract.ENV_AGENT_PORT: str(port),
            contract.ENV_RESTARTS_LEFT: str(restarts_left),
            contract.ENV_PERMANENT_EXIT_CODES: permanent,
        }
        command = [
            sys.executable,
            "-m",
            "dtjob.launcher",
            "--",
            sys.executable,
            str(tmp_path / "trainer.py"),
            str(tmp_path),
            mode,
        ]
        agents[pod] = subprocess.Popen(
            command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        _STARTED.append(agents[pod])
    return agents


def _records(tmp_path: Path) -> dict[tuple[int, int], dict[str, Any]]:
    out = {}
    for path in tmp_path.glob("rank*-round*.json"):
        record = json.loads(path.read_text())
        out[(record["rank"], record["round"])] = record
    return out


def _finish(agents: dict[int, subprocess.Popen[str]], timeout: float = 120) -> dict[int, tuple[int, str]]:
    results = {}
    for pod, agent in agents.items():
        try:
            _, err = agent.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)  # its trainers too: they hold its stderr open
            _, err = agent.communicate()
            pytest.fail(f"agent of pod {pod} did not exit within {timeout}s:\n{err}")
        results[pod] = (agent.returncode, err)
    return results


def _stop(agent: subprocess.Popen[str]) -> str:
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=60)
    return err


def test_a_killed_trainer_restarts_the_whole_gang_in_place_from_warm_standbys(tmp_path: Path) -> None:
    results = _finish(_agents(tmp_path, "kill"))
    assert {pod: code for pod, (code, _) in results.items()} == {0: 0, 1: 0}, results
    records = _records(tmp_path)
    assert set(records) == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for rank in (0, 1):
        again = records[(rank, 1)]
        assert again["cause"] == "rank 1 (pod 1) exited 137 (SIGKILL)"
        assert again["warm"], "round 1 ran in a new interpreter, not the standby"
        assert again["pid"] != records[(rank, 0)]["pid"]
        said = "restart in place 1: rank 1 (pod 1) exited 137 (SIGKILL) (1 of 1 trainers from warm standbys)"
        assert said in results[rank][1]


def test_a_gang_restarts_in_place_as_often_as_restarts_are_left_then_the_pod_fails(tmp_path: Path) -> None:
    agents = _agents(tmp_path, "always", restarts_left=2)
    code, err = _finish({1: agents[1]})[1]
    assert code == 128 + signal.SIGKILL
    assert contract.parse_in_place_line(err) == 2
    assert "no restarts left (2 in place; elastic.maxRestarts)" in err
    assert {r for (_, r) in _records(tmp_path)} == {0, 1, 2}
    _stop(agents[0])


def test_a_permanent_exit_code_fails_the_pod_without_a_restart_in_place(tmp_path: Path) -> None:
    agents = _agents(tmp_path, "exit2")
    code, err = _finish({1: agents[1]})[1]
    assert code == 2
    assert "exit code 2 is permanent" in err
    assert contract.parse_in_place_line(err) == 0
    assert _stop(agents[0]) is not None
    assert {r for (_, r) in _records(tmp_path)} == {0}


def test_no_restart_in_place_without_every_pods_agent(tmp_path: Path) -> None:
    # Only pod 1 of 2: its agent never reaches a coordinator, so its failure is the operator's.
    (tmp_path / "ready-0-0").touch()
    (tmp_path / "rank0-round0.json").write_text(json.dumps({"rank": 0, "round": 0, "pid": 0}))
    code, err = _finish(_agents(tmp_path, "kill", pods=(1,)))[1]
    assert code == 128 + signal.SIGKILL
    assert "the coordinator (pod 0's agent) is not answering" in err


def test_sigterm_reaches_the_trainers_and_the_pod_exits_75_with_restarts_in_place(tmp_path: Path) -> None:
    agents = _agents(tmp_path, "sigterm")
    deadline = time.monotonic() + 60
    while len(_records(tmp_path)) < 2:
        assert time.monotonic() < deadline, "trainers did not start"
        time.sleep(0.05)
    for agent in agents.values():
        agent.send_signal(signal.SIGTERM)
    results = _finish(agents)
    assert {pod: code for pod, (code, _) in results.items()} == {0: 75, 1: 75}


def test_a_taken_agent_port_turns_restarts_in_place_off_not_the_pod(tmp_path: Path) -> None:
    # Something else listens there (and never answers): pod 0's agent cannot, and pod 1's agent,
    # connected to it, hears no coordinator.
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        agents = _agents(tmp_path, "kill", port=port)
        code, err = _finish({1: agents[1]})[1]
        assert code == 128 + signal.SIGKILL, err  # its failure goes to the operator, as without
        # (the trainer may die before the agent's first beat goes unanswered, or after)
        assert "the coordinator (pod 0's agent) is not answering" in err or "stopped answering" in err
        err0 = _stop(agents[0])
    assert f"cannot listen on DTJOB_AGENT_PORT={port}" in err0
    assert {r for (_, r) in _records(tmp_path)} == {0}


def _lines(sock: socket.socket) -> Iterator[dict[str, Any]]:
    for line in sock.makefile("r", encoding="utf-8"):
        message = json.loads(line)
        if "ack" not in message:
            yield message


def _join(sock: socket.socket, pod: int) -> None:
    """Say hello and beat, and wait for the ack: the coordinator has then counted this pod (each
    connection has its own thread, so without the wait a failure sent on another connection can be
    decided before this hello is read, and the coordinator rightly gives up)."""
    sock.sendall(f'{{"hello": {pod}, "job": "uid-a"}}\n{{"beat": {pod}}}\n'.encode())
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = sock.recv(1)  # byte by byte: nothing after the ack may be taken from the socket
        assert chunk, "the coordinator closed the connection"
        answer += chunk
    assert json.loads(answer) == {"ack": True}


def test_the_coordinator_refuses_another_job_and_gives_up_when_a_pod_leaves_mid_restart() -> None:
    coordinator = Coordinator(free_port(), pods=2, restarts_left=3, job_uid="uid-a")
    coordinator.start()
    address = ("127.0.0.1", coordinator.port)
    with socket.create_connection(address, timeout=10) as stranger:
        stranger.sendall(b'{"hello": 1, "job": "uid-b"}\n')
        assert stranger.recv(100) == b"", "another job's agent is not let in"
    pod0, pod1 = (socket.create_connection(address, timeout=10) for _ in range(2))
    with pod0, pod1:
        for pod, sock in enumerate((pod0, pod1)):
            _join(sock, pod)
        pod1.sendall(b'{"failed": 1, "round": 0, "rank": 1, "code": 137}\n')
        said0, said1 = _lines(pod0), _lines(pod1)
        assert next(said0) == {"stop": 0, "cause": "rank 1 (pod 1) exited 137 (SIGKILL)"}
        assert next(said1)["stop"] == 0
        pod0.sendall(b'{"stopped": 0, "round": 0}\n')
        pod1.shutdown(socket.SHUT_RDWR)  # its pod went away before it stopped its trainers
        started = time.monotonic()
        assert next(said0) == {"give_up": 0, "reason": "the agent of pod 1 left during the restart in place"}
        assert time.monotonic() - started < STOP_TIMEOUT_SECONDS, "at once, not after the stop timeout"
