"""Durable checkpoints written from the in-memory snapshot, in the background.

A periodic checkpoint used to stall its step for the whole write (serialize every shard, write
and fsync it on the shared volume, agree, publish). With snapshots on, the step only copies its
state to the host as for any snapshot (snapshot.py); the snapshot's thread serializes it once,
writes it to memory and the buddy, and hands the same bytes to a checkpoint thread, which writes
them as this rank's file of the durable checkpoint and runs the protocol of a synchronous save
(`Checkpointer.write`: staging directory, every rank's file and index agreed, rank 0 checks the
fence, writes the manifest and renames the directory into place) over a gloo group of its own,
while the next steps train and take their snapshots. So a checkpoint is still complete or absent,
and still has one writer: rank 0 of the fenced gang, one write at a time (the next checkpoint
waits for the one in flight; a synchronous save, at a stop or the last step, waits for it first:
`ElasticSession.save`).

The outcome (the published directory, or the `CheckpointWriteError` every rank got) is kept for
the session to collect at a point where every rank has it: a snapshot whose agreement found no
rank's checkpoint thread busy (`Snapshots.take(busy_elsewhere=)`), or after `wait`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtjob.trainer.checkpoint import Checkpointer, CheckpointWriteError, RankFileInfo, write_rank_bytes
from dtjob.trainer.parallel.comm import new_group
from dtjob.trainer.snapshot import Then


@dataclass(frozen=True)
class Outcome:
    """One background checkpoint's end: `path` once published, else `error` (on every rank)."""

    step: int
    seconds: float  # on the thread: writing this rank's file and the protocol
    time: float  # when it ended (unix seconds)
    path: Path | None = None
    error: CheckpointWriteError | None = None


class BackgroundCheckpoints:
    """The durable checkpoints of one rank's session written from its snapshots. Every rank
    constructs it at the same point (it creates the protocol's gloo group)."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer
        self.group = new_group(backend="gloo") if checkpointer.world_size > 1 else None
        self._thread: threading.Thread | None = None
        self.outcomes: list[Outcome] = []  # appended by the thread, until collected
        self._lock = threading.Lock()

    def job(self, step: int) -> Then:
        """What the snapshot of `step` runs after it: start writing it as the durable checkpoint of
        `step` on the checkpoint thread (call `wait` first: one write at a time)."""

        def run(data: memoryview | None, info: Mapping[str, Any] | str) -> None:
            self._thread = threading.Thread(
                target=self._write, args=(step, data, info), name="dtjob-checkpoint", daemon=True
            )
            self._thread.start()

        return run

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _write(self, step: int, data: memoryview | None, info: Mapping[str, Any] | str) -> None:
        def write(staging: Path) -> RankFileInfo | str:
            if data is None or isinstance(info, str):
                return str(info)  # this rank's snapshot failed: every rank learns why
            return write_rank_bytes(staging, info["name"], data, info["sha256"], info["index"])

        # The snapshot's meta has the optimizer's extra_state; a rank without one writes no
        # manifest (only rank 0 does, and only when every rank wrote its file).
        meta = info["meta"] if not isinstance(info, str) else {}
        started = time.perf_counter()
        path, error = None, None
        try:
            path = self.checkpointer.write(step, write, meta, group=self.group)
        except CheckpointWriteError as err:
            error = err
        except Exception as err:  # the protocol's messages failed: a peer is gone
            error = CheckpointWriteError(f"checkpoint of step {step}: {type(err).__name__}: {err}", False)
        with self._lock:
            self.outcomes.append(Outcome(step, time.perf_counter() - started, time.time(), path, error))

    def collect(self, before: int | None = None) -> list[Outcome]:
        """The outcomes not yet collected of the writes of steps before `before` (None: all): the
        write of the snapshot just started is not everywhere yet."""
        with self._lock:
            done = [o for o in self.outcomes if before is None or o.step < before]
            self.outcomes = [o for o in self.outcomes if o not in done]
        return done
