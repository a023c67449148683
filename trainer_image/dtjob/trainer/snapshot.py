"""In-memory snapshots: the training state of a recent step in host memory, with a buddy copy in
another pod, so an unplanned restart resumes there instead of at the newest durable checkpoint.

A snapshot IS a checkpoint of its step (checkpoint.py's rank file: `rank_payload`, torch.save'd),
written to a tmpfs directory the trainer processes do not own: by default /dev/shm/dtjob-snapshots
(DTJOB_SNAPSHOT_DIR), which outlives the processes the pod's agent restarts in place, not the pod.
Layout, under one directory per run (`run-<sha of the job's uid or checkpoint directory>`):

    step-00000012/
        rank-00003.pt     the rank file of rank 3 (its own, or the buddy copy it received)
        rank-00003.json   {"name", "sha256", "bytes", "index", "meta"}: written last, so a
                          .json marks a complete file; meta is the manifest's (step, world_size,
                          extra_state, data, config, ...)

Taking one (`Snapshots.take`, every `every` steps, at the step boundary): the rank's shards are
copied to host buffers (CPU copies; on CUDA non-blocking into pinned buffers, reused), then a
background thread serializes them, writes the rank's file, sends the bytes to its buddy, rank
(rank + nproc_per_worker) % world (the same local rank of the next pod) and stores the copy it
receives from its owner (rank - nproc_per_worker) % world. The exchange runs on a gloo group of
its own, so it never waits behind (or blocks) the training's collectives. At most one snapshot is
in flight: every rank agrees (one all-reduce of 2 integers) whether any rank is still writing,
and if so all skip this step's (`skipped` counts them). The same all-reduce tells every rank the
newest step complete on all ranks (own file and buddy copy written): every older step is deleted,
so memory holds that one and the one being written.

Recovery from memory: snapshot_recovery.py.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtjob.trainer.checkpoint import (
    list_step_dirs,
    rank_file_name,
    rank_index,
    rank_payload,
    rng_state,
    step_dir_name,
)
from dtjob.trainer.metrics import TrainerMetrics
from dtjob.trainer.parallel.comm import control_group, new_group
from dtjob.trainer.train_state import TrainState

log = logging.getLogger("dtjob.trainer.snapshot")

INFO_SUFFIX = ".json"
_CGROUP = Path("/sys/fs/cgroup")
# Host bytes per byte of a rank's state (own O, buddy B): the newest complete snapshot and the one
# being written, each own + buddy file on the tmpfs (2 (O + B)); while writing, the serialized own
# bytes and the received buddy bytes (O + B); the host buffers the step copies into (O). Not
# counted: the serialized own bytes a durable checkpoint being written from a snapshot holds (O
# more, while it is written; checkpoint_background.py).
FILES_HELD = 2
IN_FLIGHT = 1


class SnapshotMemoryError(RuntimeError):
    """The snapshots would not fit the pod's host memory."""


def run_dir_name(identity: str) -> str:
    """The directory of one run's snapshots: a new job (another uid or checkpoint directory) never
    recovers another's state from a pod's memory."""
    return "run-" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def host_bytes(own: int, buddy: int) -> int:
    """Host memory one rank's snapshots take at most (see FILES_HELD)."""
    return (FILES_HELD + IN_FLIGHT) * (own + buddy) + own


def pod_memory_left() -> int | None:
    """Bytes the container's cgroup (v2) still allows: memory.max - memory.current; None unlimited
    or unreadable."""
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
    except OSError:
        return None
    if limit == "max":
        return None
    try:
        used = int((_CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        used = 0
    return int(limit) - used


@dataclass
class _Pending:
    """One snapshot copied to the host, for the writing thread."""

    step: int
    tensors: dict[str, torch.Tensor]
    index: dict[str, tuple[int, int, list[int], str]]
    rank_state: dict[str, Any]
    global_state: dict[str, Any] | None
    meta: dict[str, Any]
    copied: torch.cuda.Event | None
    then: Then | None


# Runs on the snapshot's thread once the snapshot is written and exchanged (a durable checkpoint
# written from its bytes, checkpoint_background.py): the serialized rank file and its info, or
# None and why this rank has none.
Then = Callable[[memoryview | None, Mapping[str, Any] | str], None]


def store(root: Path, step: int, owner: int, data: bytes | memoryview, info: Mapping[str, Any]) -> None:
    """Write one rank file and its info (the info last: it marks the file complete)."""
    directory = root / step_dir_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    name = rank_file_name(owner)
    for path, content in (
        (directory / name, data),
        (directory / (name + INFO_SUFFIX), json.dumps(info).encode()),
    ):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(content)
        os.replace(tmp, path)


def inventory(root: Path) -> list[dict[str, Any]]:
    """The complete rank files under `root`: their infos, each with its "step" and "owner"."""
    found: list[dict[str, Any]] = []
    for step, directory in list_step_dirs(root):
        for info_path in sorted(directory.glob("rank-*.pt" + INFO_SUFFIX)):
            try:
                info = json.loads(info_path.read_text())
                owner = int(info_path.name.removeprefix("rank-").split(".")[0])
            except (OSError, ValueError):
                continue  # a file removed while listing, or a torn one
            if (directory / info["name"]).is_file():
                found.append({**info, "step": step, "owner": owner})
    return found


def prune(root: Path, keep: set[int] | None = None, older_than: int | None = None) -> None:
    """Delete the step directories not in `keep` (None: keep all) or older than `older_than`."""
    for step, directory in list_step_dirs(root):
        if (keep is not None and step not in keep) or (older_than is not None and step < older_than):
            shutil.rmtree(directory, ignore_errors=True)


class Snapshots:
    """One rank's in-memory snapshots (see the module docstring). Every rank constructs it at the
    same point (it creates the exchange's gloo group) and calls `take` after the same steps.

    root: the pod's snapshot directory (DTJOB_SNAPSHOT_DIR); identity: the run's (job uid, else
    its checkpoint directory); pod_size: processes per pod (LOCAL_WORLD_SIZE); every: steps
    between snapshots (> 0); memory_limit: host bytes the pod's snapshots may take (0: the
    cgroup's limit); metrics: where to publish each completed snapshot's seconds, bytes and step."""

    def __init__(
        self,
        root: Path,
        identity: str,
        rank: int,
        world_size: int,
        pod_size: int,
        every: int,
        memory_limit: int = 0,
        metrics: TrainerMetrics | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"snapshot every must be >= 1 (off: construct no Snapshots), got {every}")
        self.root = root / run_dir_name(identity)
        self.rank = rank
        self.world_size = world_size
        self.pod_size = pod_size
        self.every = every
        self.memory_limit = memory_limit
        self.metrics = metrics
        # The same local rank of the next pod; none with one pod (its loss is the job's).
        self.buddy = (rank + pod_size) % world_size if world_size > pod_size else None
        self.owner = (rank - pod_size) % world_size if world_size > pod_size else None
        if self.buddy is None and rank == 0:
            log.warning(
                "snapshots: one pod (%d ranks), so no buddy copies: losing the pod loses the snapshot",
                world_size,
            )
        self.group = new_group(backend="gloo") if world_size > 1 else None
        self.skipped = 0  # snapshots skipped because the previous was still being written
        self.taken = 0
        self.completed = -1  # the newest step whose own file and buddy copy this rank wrote
        self.error: str | None = None
        self.write_seconds: list[float] = []  # per snapshot: serialize, write, exchange (the thread)
        self.own_bytes = 0
        self.idle_everywhere = True  # see `take`
        self._thread: threading.Thread | None = None
        self._host: dict[str, torch.Tensor] = {}
        self._checked = False

    # -- taking ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(
        self,
        step: int,
        state: TrainState,
        meta: Mapping[str, Any],
        then: Then | None = None,
        busy_elsewhere: bool = False,
    ) -> bool:
        """Snapshot `step` (every rank calls it after the same steps); False when skipped because
        a rank still writes the previous one. Returns once the state is copied to the host.
        `then` (every rank alike): run on the thread after this snapshot; such a snapshot is never
        skipped: every rank first waits for the one in flight. `busy_elsewhere`: this rank's other
        background work (a checkpoint being written) is not done; `idle_everywhere` then says
        whether every rank's is, agreed in the same all-reduce."""
        if then is not None:
            self.wait()
        busy = self._thread is not None and self._thread.is_alive()
        flags = torch.tensor([int(busy), -self.completed, int(busy_elsewhere)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control_group())
        self.idle_everywhere = not flags[2]
        if flags[0]:
            self.skipped += 1
            return False
        everywhere = -int(flags[1])  # the newest step complete on every rank
        if everywhere >= 0:
            prune(self.root, older_than=everywhere)
        shards = state.state_shards()
        if not self._checked:
            self._check_memory(sum(s.local.numel() * s.local.element_size() for s in shards.values()))
            self._checked = True
        on_cuda = any(s.local.is_cuda for s in shards.values())
        tensors: dict[str, torch.Tensor] = {}
        for key, s in shards.items():
            src = s.local.detach().reshape(-1)
            buf = self._host.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                self._host[key] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            tensors[key] = buf
        copied = None
        if on_cuda:
            copied = torch.cuda.Event()
            copied.record()
        pending = _Pending(
            step=step,
            tensors=tensors,
            index=rank_index(shards),
            rank_state=rng_state(),
            # The scheduler's and the user's values change in place at the next step.
            global_state=copy.deepcopy(state.global_state()) if self.rank == 0 else None,
            meta={**meta, "step": step, "world_size": self.world_size, "extra_state": state.extra_state()},
            copied=copied,
            then=then,
        )
        self.taken += 1
        self._thread = threading.Thread(
            target=self._write, args=(pending,), name="dtjob-snapshot", daemon=True
        )
        self._thread.start()
        return True

    def _write(self, p: _Pending) -> None:
        started = time.perf_counter()
        data: memoryview | None = None
        info: dict[str, Any] | str = "no snapshot"
        try:
            if p.copied is not None:
                p.copied.synchronize()
            buffer = io.BytesIO()
            torch.save(rank_payload(self.rank, p.tensors, p.rank_state, p.global_state), buffer)
            data = buffer.getbuffer()  # no copy: the serialized bytes are written and sent from here
            info = {
                "name": rank_file_name(self.rank),
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "index": p.index,
                "meta": p.meta,
            }
            store(self.root, p.step, self.rank, data, info)
            theirs = 0
            if self.buddy is not None and self.owner is not None:
                their_data, their_info = self._exchange(data, info)
                store(self.root, p.step, self.owner, their_data, their_info)
                theirs = len(their_data)
            self.completed = p.step
            seconds = time.perf_counter() - started
            self.write_seconds.append(seconds)
            if self.metrics is not None:
                self.metrics.snapshot_seconds.set(seconds)
                self.metrics.snapshot_bytes.labels("own").set(len(data))
                self.metrics.snapshot_bytes.labels("buddy").set(theirs)
                self.metrics.snapshot_step.set(p.step)
        except Exception as err:  # the gang is failing (a peer gone): recovery uses older steps
            self.error = f"{type(err).__name__}: {err}"
            log.warning("snapshot of step %d not completed: %s", p.step, self.error)
            info = f"rank {self.rank}: snapshot of step {p.step} not completed: {self.error}"
            data = None
        if p.then is not None:
            p.then(data, info)

    def _exchange(self, data: memoryview, info: Mapping[str, Any]) -> tuple[memoryview, dict[str, Any]]:
        """Send our file to the buddy, receive the owner's: sizes, then the info, then the file."""
        assert self.buddy is not None and self.owner is not None
        header = bytearray(json.dumps(info).encode())
        sizes = torch.tensor([len(header), len(data)], dtype=torch.int64)
        their_sizes = torch.empty(2, dtype=torch.int64)
        _both(sizes, self.buddy, their_sizes, self.owner, self.group)
        their_header = torch.empty(int(their_sizes[0]), dtype=torch.uint8)
        _both(torch.frombuffer(header, dtype=torch.uint8), self.buddy, their_header, self.owner, self.group)
        theirs = torch.empty(int(their_sizes[1]), dtype=torch.uint8)
        _both(torch.frombuffer(data, dtype=torch.uint8), self.buddy, theirs, self.owner, self.group)
        return memoryview(theirs.numpy().data), json.loads(their_header.numpy().tobytes())

    def wait(self, timeout: float | None = None) -> None:
        """Until the snapshot in flight (if any) is written and exchanged."""
        if self._thread is not None:
            self._thread.join(timeout)

    def finish(self) -> None:
        """The run is complete (every rank calls it): free the pod's memory of its snapshots."""
        self.wait()
        dist.barrier(group=control_group())
        if self.rank % self.pod_size == 0:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- host memory -------------------------------------------------------------------------------
    def _check_memory(self, own: int) -> None:
        """Refuse (on every rank alike) when some pod's snapshots would not fit its memory."""
        self.own_bytes = own
        limit = self.memory_limit or pod_memory_left()
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, (own, limit), group=control_group())
        sizes = [int(o) for o, _ in everyone]

        def need(r: int) -> int:
            owner = (r - self.pod_size) % self.world_size
            return host_bytes(sizes[r], sizes[owner] if self.owner is not None else 0)

        if self.rank == 0:
            mine = need(0)
            log.info(
                "snapshots every %d step(s) in %s: %.1f MiB of host memory per rank (own state %.1f MiB, "
                "buddy copy %.1f MiB)",
                self.every,
                self.root,
                mine / 2**20,
                sizes[0] / 2**20,
                (sizes[(0 - self.pod_size) % self.world_size] if self.owner is not None else 0) / 2**20,
            )
        for first in range(0, self.world_size, self.pod_size):
            pod = range(first, min(first + self.pod_size, self.world_size))
            total = sum(need(r) for r in pod)
            allowed = everyone[first][1]
            if allowed is not None and total > allowed:
                where = "DTJOB_SNAPSHOT_MEMORY_LIMIT" if self.memory_limit else "the container's memory limit"
                raise SnapshotMemoryError(
                    f"snapshots need {total / 2**20:.1f} MiB of host memory in pod {first // self.pod_size} "
                    f"(ranks {pod.start}-{pod.stop - 1}), {where} leaves {allowed / 2**20:.1f} MiB: "
                    "raise the pod's memory limit (or DTJOB_SNAPSHOT_MEMORY_LIMIT), or turn snapshots off "
                    "with DTJOB_SNAPSHOT_EVERY=0 (ElasticSession(snapshot_every=0))"
                )


def _both(
    send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group: dist.ProcessGroup | None
) -> None:
    """Send and receive at once (a pair of ranks may be each other's buddy and owner)."""
    works = [dist.isend(send, to, group=group), dist.irecv(recv, source, group=group)]
    for work in works:
        if work is not None:
            work.wait()
