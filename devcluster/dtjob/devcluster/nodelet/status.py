"""The parts of a pod's status the nodelet reports: container statuses and pod conditions."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def exit_code(returncode: int) -> int:
    """A process's return code as a container exit code: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class ContainerRun:
    """One container's current state, as shown in pod.status.(init)containerStatuses."""

    name: str
    image: str
    init: bool = False
    restart_count: int = 0
    state: str = "waiting"  # waiting | running | terminated
    reason: str = "ContainerCreating"
    message: str = ""
    exit_code: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    pid: int | None = None
    last_state: Obj = field(default_factory=dict)

    def waiting(self, reason: str, message: str = "") -> None:
        self.state, self.reason, self.message = "waiting", reason, message

    def running(self, pid: int) -> None:
        self.state, self.pid, self.started_at, self.reason, self.message = "running", pid, now(), "", ""

    def terminated(self, code: int, message: str = "") -> None:
        self.state, self.exit_code, self.finished_at = "terminated", code, now()
        self.reason, self.message = ("Completed" if code == 0 else "Error"), message
        self.pid = None

    def restarting(self) -> None:
        """Keeps the finished run as lastState before the next run starts."""
        self.last_state = {"terminated": self._terminated()}
        self.restart_count += 1
        self.exit_code = None

    def _terminated(self) -> Obj:
        t: Obj = {
            "exitCode": self.exit_code,
            "reason": self.reason,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
            "containerID": self.container_id(),
        }
        if self.message:
            t["message"] = self.message
        return t

    def container_id(self) -> str:
        return f"dtjob://{self.name}-{self.restart_count}"

    def status(self) -> Obj:
        if self.state == "running":
            state: Obj = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {"terminated": self._terminated()}
        else:
            state = {
                "waiting": {"reason": self.reason, **({"message": self.message} if self.message else {})}
            }
        ready = self.state == "running" or (self.init and self.state == "terminated" and self.exit_code == 0)
        out: Obj = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": ready,
            "started": self.state == "running",
            "restartCount": self.restart_count,
            "state": state,
            "lastState": self.last_state,
        }
        if self.state != "waiting" or self.last_state:
            out["containerID"] = self.container_id()
        return out


class Conditions:
    """Pod conditions with lastTransitionTime changed only when a status actually changes."""

    TYPES = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")

    def __init__(self) -> None:
        self._items: dict[str, Obj] = {}

    def set(self, kind: str, value: bool, reason: str = "") -> None:
        status = "True" if value else "False"
        old = self._items.get(kind)
        if old is not None and old["status"] == status and old.get("reason", "") == reason:
            return
        # reason None (null) deletes an earlier reason: status reports are strategic merge patches.
        item: Obj = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": now(),
            "reason": reason or None,
        }
        self._items[kind] = item

    def as_list(self) -> list[Obj]:
        return [self._items[k] for k in self.TYPES if k in self._items]
