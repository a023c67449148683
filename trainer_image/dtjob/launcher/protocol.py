"""Every message of a pod's launcher, typed: one frozen dataclass per message, one JSON line each.

    agent -> coordinator   Hello {"hello": POD, "job": UID}     first, on every connection
                           Beat {"beat": POD}                   every Liveness.agent_beat_seconds
                           Terminating {"terminating": POD}     the pod got SIGTERM
                           Failed {"failed": POD, "round": R, "rank": RANK, "code": CODE}
                           Stopped {"stopped": POD, "round": R}
    coordinator -> agent   Ack {"ack": true}                    the answer to a Beat
                           Stop {"stop": R, "cause": TEXT}      kill your trainers of round R
                           Start {"start": R + 1, "cause": TEXT}  start round R + 1
                           GiveUp {"give_up": R, "reason": TEXT}  no restart in place: leave failing
    agent -> standby       Activate {"env": {NAME: VALUE}}      become the trainer, with these variables

A message is a JSON object whose first key names it (its `TAG`) and holds its first field; the
other fields are keys of their own name. The bytes are those the launcher has always sent
(`json.dumps` of that object and a newline, tests/unit/test_launcher_protocol.py pins each), so an
agent and a coordinator of different versions keep talking during a rolling upgrade. For the same
reason `decode` ignores keys it does not know (a newer sender's extra fields); a missing or
mistyped field, or an object that names no message or two, is a ProtocolError.

What the operator reads of an agent is not here: its last log line, `dtjob.contract.in_place_line`,
with the trainer's other log lines the operator parses.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


class ProtocolError(ValueError):
    """A line that is not a message of this protocol; the text says what is wrong with it."""


class UnknownMessage(ProtocolError):
    """A JSON object that names no message this version knows (a newer sender's, or noise)."""


@dataclass(frozen=True)
class Hello:
    """An agent's first line: its pod, and its job's uid (DTJOB_JOB_UID), which must match."""

    TAG: ClassVar[str] = "hello"
    pod: int
    job: str = ""  # agents before the uid check sent none


@dataclass(frozen=True)
class Beat:
    TAG: ClassVar[str] = "beat"
    pod: int


@dataclass(frozen=True)
class Terminating:
    """The agent's pod is being deleted (SIGTERM): no restart in place while it goes."""

    TAG: ClassVar[str] = "terminating"
    pod: int


@dataclass(frozen=True)
class Failed:
    """A trainer process of `pod` exited with `code` (as a shell reports it) in `round`."""

    TAG: ClassVar[str] = "failed"
    pod: int
    round: int
    rank: int
    code: int


@dataclass(frozen=True)
class Stopped:
    """Every trainer of `pod`'s `round` is gone."""

    TAG: ClassVar[str] = "stopped"
    pod: int
    round: int


@dataclass(frozen=True)
class Ack:
    TAG: ClassVar[str] = "ack"


@dataclass(frozen=True)
class Stop:
    TAG: ClassVar[str] = "stop"
    round: int
    cause: str = ""


@dataclass(frozen=True)
class Start:
    TAG: ClassVar[str] = "start"
    round: int
    cause: str = ""  # empty: the cause of the Stop before it


@dataclass(frozen=True)
class GiveUp:
    TAG: ClassVar[str] = "give_up"
    round: int
    reason: str


@dataclass(frozen=True)
class Activate:
    """What a warm standby's agent writes to its stdin: the variables of the round it runs."""

    TAG: ClassVar[str] = "env"
    env: Mapping[str, str]


AgentMessage = Hello | Beat | Terminating | Failed | Stopped
CoordinatorMessage = Ack | Stop | Start | GiveUp
Message = AgentMessage | CoordinatorMessage | Activate

MESSAGES: tuple[type[Message], ...] = typing.get_args(Message)
_BY_TAG: dict[str, type[Message]] = {kind.TAG: kind for kind in MESSAGES}


def _keys(kind: type[Message]) -> list[tuple[str, dataclasses.Field[Any]]]:
    """(the key on the wire, the field) of each field: the first is the tag's value."""
    fields = dataclasses.fields(kind)
    return [(kind.TAG if i == 0 else f.name, f) for i, f in enumerate(fields)]


def encode(message: Message) -> bytes:
    """One JSON line, newline included."""
    obj: dict[str, Any] = {key: _plain(getattr(message, f.name)) for key, f in _keys(type(message))}
    return (json.dumps(obj or {message.TAG: True}) + "\n").encode()  # no fields (Ack): the tag says all


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


def decode(line: str | bytes) -> Message:
    """The message of one JSON line; ProtocolError (UnknownMessage when it names none) otherwise."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise ProtocolError(f"not a JSON line: {_show(line)}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"not a JSON object: {_show(line)}")
    tags = [tag for tag in obj if tag in _BY_TAG]
    if not tags:
        known = ", ".join(_BY_TAG)
        raise UnknownMessage(f"no message of this protocol ({known}) in {_show(line)}")
    if len(tags) > 1:
        raise ProtocolError(f"{_show(line)} names {len(tags)} messages ({', '.join(tags)}), not one")
    kind = _BY_TAG[tags[0]]
    values = {}
    for key, f in _keys(kind):
        if key not in obj:
            if f.default is dataclasses.MISSING:
                raise ProtocolError(f"{kind.__name__} message {_show(line)} lacks {key!r}")
            continue
        values[f.name] = _checked(kind, key, f, obj[key], line)
    if kind is Ack and obj[Ack.TAG] is not True:
        raise ProtocolError(f"Ack message {_show(line)}: 'ack' is not true")
    return kind(**values)


def _checked(kind: type[Message], key: str, f: dataclasses.Field[Any], value: Any, line: str | bytes) -> Any:
    expected = {"int": int, "str": str, "Mapping[str, str]": dict}[str(f.type)]
    ok = isinstance(value, expected) and not isinstance(value, bool)
    if ok and expected is dict:
        ok = all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    if not ok:
        raise ProtocolError(f"{kind.__name__} message {_show(line)}: {key!r} is not {f.type}")
    return value


def _show(line: str | bytes) -> str:
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    return repr(text if len(text) <= 200 else text[:197] + "...")
