"""dtjob.launcher.protocol: the bytes of every message (those the launcher sent before it was typed,
so agents and coordinators of different versions keep talking), and a clear error for a line that
is not a message."""

from __future__ import annotations

import socket

import pytest

from dtjob.launcher import protocol
from dtjob.launcher.coordinator import Coordinator
from dtjob.launcher.protocol import (
    Ack,
    Activate,
    Beat,
    Failed,
    GiveUp,
    Hello,
    ProtocolError,
    Start,
    Stop,
    Stopped,
    Terminating,
    UnknownMessage,
    decode,
    encode,
)
from tests.trainer.runtime_gang import free_port

# Each message and its line, as `json.dumps` of the launcher's dicts wrote it.
WIRE: list[tuple[protocol.Message, bytes]] = [
    (Hello(pod=1, job="uid-a"), b'{"hello": 1, "job": "uid-a"}\n'),
    (Beat(pod=3), b'{"beat": 3}\n'),
    (Terminating(pod=0), b'{"terminating": 0}\n'),
    (Failed(pod=1, round=2, rank=5, code=137), b'{"failed": 1, "round": 2, "rank": 5, "code": 137}\n'),
    (Stopped(pod=1, round=2), b'{"stopped": 1, "round": 2}\n'),
    (Ack(), b'{"ack": true}\n'),
    (
        Stop(round=0, cause="rank 1 (pod 1) exited 137 (SIGKILL)"),
        b'{"stop": 0, "cause": "rank 1 (pod 1) exited 137 (SIGKILL)"}\n',
    ),
    (Start(round=1, cause="rank 1 (pod 1) exited 1"), b'{"start": 1, "cause": "rank 1 (pod 1) exited 1"}\n'),
    (
        GiveUp(round=0, reason="the agent of pod 1 left during the restart in place"),
        b'{"give_up": 0, "reason": "the agent of pod 1 left during the restart in place"}\n',
    ),
    (
        Activate({"DTJOB_IN_PLACE_RESTARTS": "1", "DTJOB_RESTART_CAUSE": "r\u00e9"}),
        b'{"env": {"DTJOB_IN_PLACE_RESTARTS": "1", "DTJOB_RESTART_CAUSE": "r\\u00e9"}}\n',
    ),
]


@pytest.mark.parametrize(("message", "line"), WIRE, ids=[type(m).__name__ for m, _ in WIRE])
def test_each_message_has_the_bytes_of_before_and_reads_back(message: protocol.Message, line: bytes) -> None:
    assert encode(message) == line
    assert decode(line) == message
    assert decode(line.decode()) == message


def test_every_message_kind_is_pinned() -> None:
    assert {type(m) for m, _ in WIRE} == set(protocol.MESSAGES)


def test_a_line_of_an_older_or_newer_sender_reads() -> None:
    # An agent from before the job uid check says no "job"; a newer one may add keys.
    assert decode(b'{"hello": 2}\n') == Hello(2, "")
    assert decode('{"beat": 2, "load": 0.5}') == Beat(2)
    assert decode('{"stop": 4}') == Stop(4, "")


@pytest.mark.parametrize(
    ("line", "error", "says"),
    [
        (b"hello\n", ProtocolError, "not a JSON line: 'hello'"),
        (b"[1, 2]\n", ProtocolError, r"not a JSON object: '\[1, 2\]'"),
        (b'{"shutdown": 1}\n', UnknownMessage, r"no message of this protocol \(hello, beat, "),
        (b'{"beat": 1, "stopped": 1}\n', ProtocolError, r"names 2 messages \(beat, stopped\), not one"),
        (b'{"failed": 1, "round": 0, "code": 137}\n', ProtocolError, "Failed message .* lacks 'rank'"),
        (b'{"failed": "1", "round": 0, "rank": 1, "code": 9}\n', ProtocolError, "'failed' is not int"),
        (b'{"beat": true}\n', ProtocolError, "Beat message .*'beat' is not int"),
        (b'{"give_up": 0, "reason": null}\n', ProtocolError, "'reason' is not str"),
        (b'{"ack": false}\n', ProtocolError, "'ack' is not true"),
        (b'{"env": {"A": 1}}\n', ProtocolError, r"'env' is not Mapping\[str, str\]"),
    ],
)
def test_a_line_that_is_no_message_raises_saying_why(line: bytes, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        decode(line)


def test_protocol_errors_are_value_errors() -> None:
    """The receivers' `except ValueError` (a malformed JSON line before) still catches them."""
    assert issubclass(UnknownMessage, ProtocolError) and issubclass(ProtocolError, ValueError)


def test_the_coordinator_skips_a_newer_agents_message_and_drops_a_malformed_line() -> None:
    coordinator = Coordinator(free_port(), pods=1, restarts_left=0, job_uid="uid-p")
    coordinator.start()
    address = ("127.0.0.1", coordinator.port)
    with socket.create_connection(address, timeout=10) as stranger:
        stranger.sendall(b'{"resize": 4}\n')
        assert stranger.recv(100) == b"", "a line before the hello closes the connection"
    with socket.create_connection(address, timeout=10) as agent:
        agent.sendall(b'{"hello": 0, "job": "uid-p"}\n{"resize": 4}\n{"beat": 0}\n')
        assert agent.makefile("rb").readline() == b'{"ack": true}\n', "the unknown line is skipped"
    with socket.create_connection(address, timeout=10) as agent:
        agent.sendall(b'{"hello": 0, "job": "uid-p"}\n{"beat": "zero"}\n')
        assert agent.recv(100) == b"", "a malformed line closes the connection"
