"""A real pod agent (`python -m dtjob.launcher`) against a coordinator played by the test: the
agent's lines are the protocol's bytes, and its timeouts follow DTJOB_HEARTBEAT_TIMEOUT (T = 6 s:
no answer to its failure within 1.5 T = 9 s, not the default's 15 s)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dtjob import contract
from dtjob.launcher import protocol
from tests.trainer.runtime_gang import SOURCE_ROOTS

pytestmark = pytest.mark.slow

# Fails once the test's coordinator has acked the agent's first beat (the agent then counts the
# coordinator as answering, and reports the failure to it).
TRAINER = r"""
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.02)
sys.exit(1)
"""


class SilentCoordinator:
    """Acks every beat and records every line, but never answers a failure."""

    def __init__(self, go: Path) -> None:
        self.go = go
        self.lines: list[bytes] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            for line in conn.makefile("rb"):
                self.lines.append(line)
                if isinstance(protocol.decode(line), protocol.Beat):
                    conn.sendall(protocol.encode(protocol.Ack()))
                    self.go.touch()


def test_an_agent_speaks_the_protocol_and_waits_1_5_t_for_an_answer(tmp_path: Path) -> None:
    (tmp_path / "trainer.py").write_text(TRAINER)
    go = tmp_path / "go"
    coordinator = SilentCoordinator(go)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, SOURCE_ROOTS)),
        contract.ENV_MASTER_ADDR: "127.0.0.1",
        contract.ENV_WORLD_SIZE: "2",
        contract.ENV_RANK: "1",
        contract.ENV_POD_RANK: "1",
        contract.ENV_PODS: "2",
        contract.ENV_AGENT_PORT: str(coordinator.port),
        contract.ENV_RESTARTS_LEFT: "3",
        contract.ENV_JOB_UID: "uid-live",
        contract.ENV_HEARTBEAT_TIMEOUT: "6",
    }
    command = [
        sys.executable,
        "-m",
        "dtjob.launcher",
        "--",
        sys.executable,
        str(tmp_path / "trainer.py"),
        str(go),
    ]
    agent = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert agent.returncode == 1, agent.stderr
    assert "local rank 0 (rank 1) exited 1; no answer from the coordinator within 9s" in agent.stderr
    assert contract.parse_in_place_line(agent.stderr) == 0
    assert coordinator.lines[:2] == [b'{"hello": 1, "job": "uid-live"}\n', b'{"beat": 1}\n']
    assert b'{"failed": 1, "round": 0, "rank": 1, "code": 1}\n' in coordinator.lines
    assert set(coordinator.lines[1:]) == {
        b'{"beat": 1}\n',
        b'{"failed": 1, "round": 0, "rank": 1, "code": 1}\n',
    }
