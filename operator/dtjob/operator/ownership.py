"""One writer per checkpoint directory: a job that has not started yet waits while another live
job of its namespace uses the same directory (reconciler rule 2).

"The same directory" (`CheckpointDir`): the trainer writes at the root of the volume of
spec.checkpoint.volume (mounted at spec.checkpoint.mountPath, no subPath), so the directory is
that volume source, whatever the mount path:

- persistentVolumeClaim: the claim's name (a PersistentVolume binds one claim, and jobs of one
  namespace are compared only);
- hostPath, nfs, and any other source with a `path` (cephfs, glusterfs, ...): the source without
  its path (nfs: the server, lower case), and the path normalised (`/data//ckpt/` is `/data/ckpt`);
  two paths conflict when they are equal or one lies inside the other (`/data` holds
  `/data/ckpt`: a trainer that lists or prunes `/data` reaches into it);
- any other source that can be shared (csi, iscsi, ...): the whole source, keys sorted;
- emptyDir, ephemeral, configMap, secret, downwardAPI, projected: never shared by two jobs
  (per pod, or read-only), so no claim.

readOnly flags (and hostPath's `type`) do not make another directory, and neither does the volume's
name.

Who owns a directory: of the live jobs on it, one that started (has a status.phase) before any
that did not, then the older by creationTimestamp, then by name. A job that already started is
never held by this rule: it started as the owner (or after the owner finished). A job is live
until it is Succeeded or Failed and none of its pods still runs (a failed job's running workers
are deleted gracefully and may write a last checkpoint in their grace period), or until it is
gone from the API server.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from dtjob.operator.timefmt import from_rfc3339

REASON = "CheckpointDirInUse"
FINISHED_PHASES = {"Succeeded", "Failed"}
# Volume sources that no two pods share, or that cannot be written: no checkpoint directory to own.
UNSHARED = {"emptyDir", "ephemeral", "configMap", "secret", "downwardAPI", "projected"}
# Keys that change how a directory is mounted, not which directory it is.
MOUNT_ONLY = {"readOnly", "type"}
NEVER = datetime.max.replace(tzinfo=UTC)


@dataclass(frozen=True)
class CheckpointDir:
    """A checkpoint directory as compared across jobs: the volume kind, where (claim, server, or
    the whole source), and the normalised path inside it (None: the source has no path)."""

    kind: str
    where: str
    path: str | None = None

    def overlaps(self, other: CheckpointDir) -> bool:
        """The same directory, or one inside the other."""
        if (self.kind, self.where) != (other.kind, other.where):
            return False
        if self.path is None or other.path is None:
            return self.path == other.path
        return _inside(self.path, other.path) or _inside(other.path, self.path)

    def describe(self) -> str:
        if self.kind == "persistentVolumeClaim":
            return f"persistentVolumeClaim {self.where}"
        if self.kind == "nfs":
            return f"nfs {self.where}:{self.path}"
        if self.path is not None and self.where == "{}":
            return f"{self.kind} {self.path}"
        return f"{self.kind} {self.where}" + (f" path {self.path}" if self.path is not None else "")


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _normal_path(path: str) -> str:
    """`/data//ckpt/.` -> `/data/ckpt`; a relative path keeps its form (`ckpt/` -> `ckpt`)."""
    normal = posixpath.normpath(path)
    # POSIX keeps a leading `//` (implementation-defined); Linux, where the volume is, does not.
    return "/" + normal.lstrip("/") if normal.startswith("//") else normal


def _without(source: Mapping[str, Any], keys: set[str]) -> dict[str, Any]:
    return {k: v for k, v in source.items() if k not in keys}


def checkpoint_dir(job: Mapping[str, Any]) -> CheckpointDir | None:
    """The job's checkpoint directory (None: no spec.checkpoint, or a volume no two jobs share).
    Reads the raw spec: another job's spec may be one the model rejects."""
    checkpoint = (job.get("spec") or {}).get("checkpoint")
    volume = checkpoint.get("volume") if isinstance(checkpoint, Mapping) else None
    if not isinstance(volume, Mapping):
        return None
    kinds = sorted(k for k, v in volume.items() if k != "name" and isinstance(v, Mapping))
    if len(kinds) != 1 or kinds[0] in UNSHARED:
        return None  # a valid VolumeSource has exactly one source
    kind = kinds[0]
    source = _without(volume[kind], MOUNT_ONLY)
    if kind == "persistentVolumeClaim":
        return CheckpointDir(kind, str(source.get("claimName")))
    path = source.get("path")
    if not isinstance(path, str):
        return CheckpointDir(kind, json.dumps(source, sort_keys=True))
    rest = _without(source, {"path"})
    if kind == "nfs":
        return CheckpointDir(kind, str(rest.get("server", "")).lower(), _normal_path(path))
    return CheckpointDir(kind, json.dumps(rest, sort_keys=True), _normal_path(path))


@dataclass(frozen=True)
class Claim:
    """Another live job of the namespace whose checkpoint directory overlaps this job's."""

    name: str
    directory: CheckpointDir
    created: datetime | None
    started: bool  # it has a status.phase: its pods may run

    def order(self) -> tuple[bool, datetime, str]:
        """Sorts the owner first: started jobs, then the older, then by name."""
        return (not self.started, self.created or NEVER, self.name)


def claim_of(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]] = ()) -> Claim | None:
    """The claim `job` has on its checkpoint directory (None: none, or it is not live: finished,
    and none of `pods`, its pods, still running)."""
    directory = checkpoint_dir(job)
    if directory is None:
        return None
    phase = (job.get("status") or {}).get("phase")
    stopping = any((p.get("status") or {}).get("phase") not in FINISHED_PHASES for p in pods)
    if phase in FINISHED_PHASES and not stopping:
        return None
    meta = job.get("metadata") or {}
    return Claim(str(meta.get("name")), directory, from_rfc3339(meta.get("creationTimestamp")), bool(phase))


def claims(
    job: Mapping[str, Any],
    others: Iterable[Mapping[str, Any]],
    pods_of: Callable[[str], Sequence[Mapping[str, Any]]],
) -> list[Claim]:
    """The claims of the other jobs of `others` (the jobs of the job's namespace) on a directory
    that overlaps the job's; `pods_of(name)`: the pods of a job (read only for finished jobs)."""
    mine = checkpoint_dir(job)
    if mine is None:
        return []
    meta = job.get("metadata") or {}
    found = []
    for other in others:
        their = other.get("metadata") or {}
        if their.get("namespace") != meta.get("namespace") or their.get("name") == meta.get("name"):
            continue
        directory = checkpoint_dir(other)
        if directory is None or not directory.overlaps(mine):
            continue
        finished = (other.get("status") or {}).get("phase") in FINISHED_PHASES
        claim = claim_of(other, pods_of(str(their.get("name"))) if finished else ())
        if claim is not None:
            found.append(claim)
    return sorted(found, key=Claim.order)


def owner_before(job: Mapping[str, Any], others: Sequence[Claim]) -> Claim | None:
    """The owner of the job's directory when it is another job (the first claim that orders
    before the job's own); None: the job may start. Only for a job that has not started."""
    mine = claim_of(job)
    if mine is None:
        return None
    return next((c for c in sorted(others, key=Claim.order) if c.order() < mine.order()), None)


def held_message(job: Mapping[str, Any], owner: Claim) -> str:
    """What the Waiting condition and the Warning event of a held job say."""
    mine = checkpoint_dir(job)
    where = mine.describe() if mine is not None else "?"
    theirs = "" if owner.directory == mine else f" ({owner.directory.describe()})"
    return (
        f"spec.checkpoint.volume ({where}) is the checkpoint directory of job {owner.name}{theirs}, "
        f"which owns it: waiting for {owner.name} to finish or be deleted (one writer per directory)"
    )


def released(old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> bool:
    """Whether this change of a job (None: absent) may free its checkpoint directory for another:
    it was live with one, and is gone or finished now."""
    if old is None or checkpoint_dir(old) is None:
        return False
    phase = (old.get("status") or {}).get("phase")
    if phase in FINISHED_PHASES:
        return False
    return new is None or (new.get("status") or {}).get("phase") in FINISHED_PHASES


def waiting_here(job: Mapping[str, Any]) -> bool:
    """Whether the job is held by this rule (its Waiting condition's reason)."""
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Waiting" and condition.get("status") == "True":
            return bool(condition.get("reason") == REASON)
    return False
