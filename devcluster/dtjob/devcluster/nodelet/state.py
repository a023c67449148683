"""What the nodelet records on disk under its --state-dir, so a later run (or `node stop` after the
nodelet was SIGKILLed) can find and remove everything a pod left behind.

    pods/<uid>/sandbox.json           {"netns", "veth", "ip"}: written before the netns exists
    pods/<uid>/procs/<container>.json {"pid", "start"}: one per running container process
    pods/<uid>/volumes/<name>/        emptyDir, configMap, secret and projected volume contents
    pods/<uid>/plans/<container>.json container_init.py's instructions
    podlogs/<uid>/<container>/<n>.log stdout+stderr of the container's n-th run (n = restartCount)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None if it
    is gone (or a zombie). Recorded beside a pid so a recycled pid is never signalled."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may contain spaces; a zombie (state Z) has
    # exited already and counts as gone.
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


@dataclass(frozen=True)
class NodeState:
    root: Path

    @property
    def pods(self) -> Path:
        return self.root / "pods"

    @property
    def logs(self) -> Path:
        return self.root / "podlogs"

    def pod_dir(self, uid: str) -> Path:
        return self.pods / uid

    def sandbox_file(self, uid: str) -> Path:
        return self.pod_dir(uid) / "sandbox.json"

    def proc_file(self, uid: str, container: str) -> Path:
        return self.pod_dir(uid) / "procs" / f"{container}.json"

    def volume_dir(self, uid: str, volume: str) -> Path:
        return self.pod_dir(uid) / "volumes" / volume

    def plan_file(self, uid: str, container: str) -> Path:
        return self.pod_dir(uid) / "plans" / f"{container}.json"

    def log_file(self, uid: str, container: str, attempt: int) -> Path:
        return self.logs / uid / container / f"{attempt}.log"

    def record_process(self, uid: str, container: str, pid: int) -> None:
        write_json(self.proc_file(uid, container), {"pid": pid, "start": process_start_time(pid)})

    def recorded_processes(self) -> list[tuple[int, int | None]]:
        out = []
        for f in self.pods.glob("*/procs/*.json"):
            try:
                rec = json.loads(f.read_text())
                out.append((int(rec["pid"]), rec.get("start")))
            except (OSError, ValueError, KeyError):
                continue
        return out

    def recorded_sandboxes(self) -> list[dict[str, str]]:
        out = []
        for f in self.pods.glob("*/sandbox.json"):
            try:
                out.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        return out
