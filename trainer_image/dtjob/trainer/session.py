"""`ElasticSession`: the elastic contract of dtjob's operator for any training script.

    session = ElasticSession()                              # env of the operator or torchrun
    model = fully_shard(build_model().to(session.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    session.track(model, optimizer, scheduler)              # what checkpoints hold
    sampler = session.batch_sampler(dataset, global_batch_size=32)
    for step in session.steps(1000):                        # resumes after the newest checkpoint
        batch = session.to_device(collate([dataset[i] for i in sampler.indices(step)]))
        loss = model(**batch).loss
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        session.report(loss)

What it does: reads the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, DTJOB_*),
picks the device (cuda:LOCAL_RANK when CUDA is there) and joins the gang (NCCL on CUDA with a gloo
group beside it, gloo on CPU); serves the metrics the operator reads on DTJOB_METRICS_PORT +
LOCAL_RANK; turns SIGTERM into "finish this step, checkpoint on every rank, exit 75" (all ranks
agree on it after every step, so they stop after the same one); checkpoints every
`checkpoint_every` steps and at the end, sharded and atomic, and resumes from the newest one at any
world size (model, optimizer, scheduler, random state, data position, the user's extras). The
batch sampler gives every step the same samples whatever the world size, so a resumed run
continues the same trajectory. When `steps()` ends it logs the closing line (dtjob.contract).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dtjob import contract
from dtjob.trainer import elastic, fence, heartbeat
from dtjob.trainer.checkpoint import Checkpointer, CheckpointWriteError, Loaded
from dtjob.trainer.checkpoint_background import BackgroundCheckpoints, Outcome
from dtjob.trainer.collectives import abort
from dtjob.trainer.collectives.abort import GangAborted
from dtjob.trainer.comm_metrics import instrument_comm
from dtjob.trainer.data import GlobalBatchSampler
from dtjob.trainer.device import backend_for, collective_device, pins, resolve_device
from dtjob.trainer.metrics import TrainerMetrics
from dtjob.trainer.parallel.comm import control_group
from dtjob.trainer.signals import StopRequest
from dtjob.trainer.snapshot import Snapshots
from dtjob.trainer.snapshot_recovery import recover
from dtjob.trainer.timing import StepTimer
from dtjob.trainer.train_state import TrainState

log = logging.getLogger("dtjob.trainer")

ENV_STEP_GATE = "DTJOB_STEP_GATE"


def _log_to_stderr(rank: int) -> None:
    """The session's own lines (resumes, checkpoints, the closing line the operator reads) go to
    stderr even in a script that configured no logging (Python's default shows warnings only)."""
    logger = logging.getLogger("dtjob")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"dtjob[rank {rank}] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class SessionError(Exception):
    """The session cannot start as configured (e.g. its metrics port is taken)."""


class Stopped(SystemExit):
    """Leaving `steps()` after a stop was agreed and a checkpoint written: exit status 75."""

    def __init__(self) -> None:
        super().__init__(contract.EXIT_STOPPED)


class ElasticSession:
    """See the module docstring. Every argument left None is read from the environment.

    checkpoint_dir: shared directory of checkpoints (env DTJOB_CHECKPOINT_DIR; None: no checkpoints,
        and a stop request exits 75 without one).
    checkpoint_every: steps between checkpoints (0: only at the end and on a stop).
    keep_checkpoints: how many of the newest checkpoints to keep.
    device: "auto", "cpu" or "cuda" (env DTJOB_DEVICE, default auto).
    metrics_port: Prometheus port, + LOCAL_RANK (env DTJOB_METRICS_PORT; 0: off).
    seed: seeds torch, numpy and random on every rank alike (model init), and the data order.
    log_file: where rank 0 appends one JSON line per step (default stdout).
    collective_timeout / rendezvous_timeout: seconds, see elastic.py.
    gang: who this process is (default: from the environment).
    step_gate: tests only (env DTJOB_STEP_GATE): before step s, wait until this file holds a
        number >= s, so a test acts at the step it chooses instead of racing the trainer.
    snapshot_dir / snapshot_every / snapshot_memory_limit: in-memory snapshots (snapshot.py; env
        DTJOB_SNAPSHOT_DIR, default /dev/shm/dtjob-snapshots; DTJOB_SNAPSHOT_EVERY, default 1, 0:
        off; DTJOB_SNAPSHOT_MEMORY_LIMIT, bytes per pod, 0: the cgroup's). Only with a
        checkpoint_dir: a restart resumes from the newest snapshot at or after the newest checkpoint.
    checkpoint_in_background: with snapshots on, a periodic checkpoint is written from the step's
        snapshot on its thread while training goes on (checkpoint_background.py); False: the step
        waits for the write, as without snapshots (a stop's and the last step's always wait).
    """

    def __init__(
        self,
        *,
        checkpoint_dir: str | None = None,
        checkpoint_every: int = 50,
        keep_checkpoints: int = 3,
        device: str | None = None,
        metrics_port: int | None = None,
        seed: int = 0,
        log_file: str | None = None,
        collective_timeout: float = 60.0,
        rendezvous_timeout: float = 300.0,
        gang: elastic.Gang | None = None,
        config: Mapping[str, Any] | None = None,
        step_gate: str | None = None,
        snapshot_dir: str | None = None,
        snapshot_every: int | None = None,
        snapshot_memory_limit: int | None = None,
        checkpoint_in_background: bool = True,
    ) -> None:
        self.gang = gang or elastic.Gang.from_env(
            collective_timeout=collective_timeout, rendezvous_timeout=rendezvous_timeout
        )
        g = self.gang
        _log_to_stderr(g.rank)
        env = contract.PodEnv.from_environ()
        self.device = resolve_device(device or env.device, g.local_rank)
        self.seed = seed
        self.config = dict(config or {})
        self.checkpoint_every = checkpoint_every
        gate = step_gate or os.environ.get(ENV_STEP_GATE)
        self._gate = Path(gate) if gate else None
        directory = checkpoint_dir if checkpoint_dir is not None else env.checkpoint_dir
        self.checkpoint_dir = Path(directory) if directory else None
        port = metrics_port if metrics_port is not None else env.metrics_port
        self.metrics = TrainerMetrics()
        self.metrics.world_size.set(g.world_size)
        self.metrics.generation.set(g.generation)
        self.metrics.rank.set(g.rank)
        # Restarts in place of this generation before this process (dtjob.launcher's agents).
        self.in_place_restarts = env.in_place_restarts
        self.metrics.in_place_restarts.labels(env.restart_cause).set(self.in_place_restarts)
        if env.restart_failed_at is not None:
            self.metrics.in_place_restart_failed_at.set(env.restart_failed_at)
        if port:
            try:
                self.metrics.serve(port + g.local_rank)
            except OSError as err:
                raise SessionError(
                    f"metrics_port (env DTJOB_METRICS_PORT): cannot serve on port {port + g.local_rank}: "
                    f"{err}"
                ) from None
        instrument_comm(self.metrics)  # bytes and seconds of every collective the wrappers issue
        self.stop = StopRequest()
        elastic.init_process_group(g, backend_for(self.device))
        # A silent peer (hung, cut off, its node gone) stops the gang in seconds (heartbeat.py).
        self.heartbeat = (
            heartbeat.start(
                f"{elastic.gang_prefix(g)}/{elastic.gang_token()}",
                g.master_addr,
                g.master_port,
                g.rank,
                g.world_size,
            )
            if g.world_size > 1
            else None
        )
        # From here on SIGTERM means "finish the step, checkpoint, exit 75". Until the gang formed
        # it killed at once: nothing was trained that a checkpoint would keep.
        self.stop.install()
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook  # a user's script that ends in an uncaught error
        self.group = control_group()
        # The directory's one writer: this gang claims it, and stops once a newer gang does.
        self.fence = fence.claim(self.checkpoint_dir, g.rank, g.generation)
        self.checkpointer = (
            Checkpointer(
                self.checkpoint_dir,
                g.rank,
                g.world_size,
                g.generation,
                keep_checkpoints,
                self.group,
                self.fence,
            )
            if self.checkpoint_dir is not None
            else None
        )
        every = snapshot_every if snapshot_every is not None else env.snapshot_every
        self.snapshots = (
            Snapshots(
                Path(snapshot_dir or env.snapshot_dir),
                env.job_uid or str(self.checkpoint_dir.resolve()),
                g.rank,
                g.world_size,
                g.local_world_size,
                every,
                snapshot_memory_limit if snapshot_memory_limit is not None else env.snapshot_memory_limit,
                self.metrics,
            )
            if self.checkpoint_dir is not None and every > 0
            else None
        )
        self.background = (
            BackgroundCheckpoints(self.checkpointer)
            if self.checkpointer is not None and self.snapshots is not None and checkpoint_in_background
            else None
        )
        self._seed_everything(seed)
        self.state: TrainState | None = None
        self.sampler: GlobalBatchSampler | None = None
        self.start_step = 0
        self.step = 0
        self._resumed = False
        # What the first step after `resume` says it resumed from, in its step log record (read by
        # the e2e and chaos tests: a step logged twice was redone): "memory" or "checkpoint".
        self._resumed_from: str | None = None
        self._first_step_time: float | None = None  # served as METRIC_FIRST_STEP_TIME
        self._timer = StepTimer(self.device)  # step times on the device's timeline (#41)
        self.last_saved_step = -1
        self._failed_saves = 0  # periodic checkpoints in a row the volume refused
        self._failing = False  # failed() was called: this process is about to end with an error
        self.last_saved_time = 0.0
        self._out: TextIO = sys.stdout
        if log_file and g.rank == 0:
            Path(log_file).parent.mkdir(parents=True, exist_ok=True)
            self._out = open(log_file, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    # -- who and where -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.gang.rank

    @property
    def world_size(self) -> int:
        return self.gang.world_size

    @property
    def generation(self) -> int:
        return self.gang.generation

    @property
    def step_seconds(self) -> float:
        """Seconds of the step, from its start to now, on the device's timeline (dtjob.trainer.timing):
        on the CPU the current step's; on CUDA the newest step whose work the GPU finished (the
        previous one in the built-in loop; the wall clock would count only the kernel launches)."""
        self._timer.stop()
        return self._timer.seconds()

    def to_device(self, batch: Any) -> Any:
        """`batch` (a tensor, or dicts/lists/tuples of them) on the session's device: pinned host
        memory and non-blocking copies from the host to CUDA."""
        if isinstance(batch, torch.Tensor):
            if pins(batch.device, self.device):
                return batch.pin_memory().to(self.device, non_blocking=True)
            return batch.to(self.device)
        if isinstance(batch, Mapping):
            return type(batch)({k: self.to_device(v) for k, v in batch.items()})  # type: ignore[call-arg]
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(v) for v in batch)
        return batch

    # -- what to checkpoint, and the data ------------------------------------------------------------
    def track(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        **extras: Any,
    ) -> None:
        """What every checkpoint saves and a resume restores: the (wrapped) model, its optimizer,
        a learning-rate scheduler, and extras (plain values and tensors, available as
        `session.extras` after a resume)."""
        self.state = TrainState(model, optimizer, scheduler, extras)

    @property
    def extras(self) -> dict[str, Any]:
        return self.state.extras if self.state is not None else {}

    def batch_sampler(
        self, dataset: Any, global_batch_size: int, *, shuffle: str = "epoch", steps: int | None = None
    ) -> GlobalBatchSampler:
        """Global-order batches over a map-style dataset (or a length). Data-parallel rank and size
        come from the tracked model (a pipeline's replicas), else rank and world size."""
        size = dataset if isinstance(dataset, int) else len(dataset)
        model = self.state.model if self.state is not None else None
        dp_rank = int(getattr(model, "data_parallel_rank", self.rank))
        dp_size = int(getattr(model, "data_parallel_size", self.world_size))
        self.sampler = GlobalBatchSampler(
            size,
            global_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=self.seed,
            shuffle=shuffle,
            steps=steps,
        )
        self.sampler.start_step = self.start_step
        return self.sampler

    # -- resume --------------------------------------------------------------------------------------
    def resume(self, check: Any = None) -> int:
        """Load the newest valid checkpoint into what `track` registered; returns its step (0: none).
        `check(manifest)` may raise to refuse a checkpoint that does not fit this run."""
        self._resumed = True
        if self.checkpointer is None or self.state is None:
            return 0
        loaded: Loaded | None = None
        lost: list[str] = []
        wanted = 0  # the newest step in the gang's memory
        if self.snapshots is not None:
            loaded, lost, wanted = recover(self.snapshots, self.state, self.checkpointer.root, check)
        in_memory = loaded is not None
        if loaded is None:
            loaded = self.checkpointer.load_latest(self.state, check)
        got = loaded.step if loaded is not None else 0
        if not in_memory and wanted > got:
            # The operator's event RecoveredFromCheckpoint: memory held a newer step than this one.
            self.metrics.resume_lost_step.set(wanted)
        if lost and not in_memory and self.rank == 0:
            durable = f"the checkpoint of step {got}" if loaded is not None else "step 0 (no checkpoint)"
            log.warning("fell back to %s: %s", durable, "; ".join(lost))
        if loaded is None:
            log.info("no checkpoint in %s; starting at step 1", self.checkpointer.root)
            return 0
        step = loaded.step
        self._resumed_from = "memory" if in_memory else "checkpoint"
        if loaded.manifest["world_size"] != self.world_size:
            # Per-rank random streams cannot be carried across world sizes; derive fresh ones.
            self._seed_everything(
                int(np.random.SeedSequence([self.seed, step, self.rank]).generate_state(1)[0])
            )
        self.start_step = self.step = step
        if self.sampler is not None:
            self.sampler.start_step = step
        m = self.metrics
        m.checkpoint_load_seconds.set(loaded.seconds)
        m.step.set(step)
        m.resumed_step.set(step)
        m.resumed_state_time.set(float(loaded.manifest.get("time") or 0))
        if not in_memory:  # a snapshot is no durable checkpoint
            self.last_saved_step = step
            self.last_saved_time = float(loaded.manifest["time"])
            m.last_checkpoint_step.set(step)
            m.last_checkpoint_timestamp.set(loaded.manifest["time"])
        log.info(
            "resumed from %s%s (written at world size %d, generation %d) in %.2fs",
            "host memory: " if in_memory else "",
            loaded.directory,
            loaded.manifest["world_size"],
            loaded.manifest["generation"],
            loaded.seconds,
        )
        return step

    # -- the loop ------------------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps still to run, start_step + 1 .. total. After each: agree on a stop,
        checkpoint when due (every checkpoint_every steps, the last step, a stop); on a stop raise
        `Stopped` (SystemExit 75). Logs the closing line when the last step is done."""
        if not self._resumed:
            self.resume()
        if self.start_step >= total:
            log.info("checkpoint step %d is already at %d steps; nothing to do", self.start_step, total)
            self._complete(total)
            return
        if elastic.agree(self.stop.requested):
            log.info(
                "stop requested before the first step; the newest checkpoint stays at step %d",
                self.start_step,
            )
            self._finish_heartbeat()
            raise Stopped
        if self.heartbeat is not None:
            self.heartbeat.arm()
        self.metrics.total_steps.set(total)
        for step in range(self.start_step + 1, total + 1):
            if self._gate is not None:
                self._wait_for_gate(step)
            self.step = step
            self._timer.start()
            yield step
            stopping = elastic.agree(self.stop.requested)
            due = self.checkpoint_every > 0 and step % self.checkpoint_every == 0
            final = stopping or step == total
            background = due and not final and self.background is not None
            if final:
                self.save(step)
            elif due and not background:
                self._save_or_go_on(step)
            # A step just checkpointed is snapshotted too: a checkpoint file damaged on its volume
            # then costs nothing (recovery prefers memory at the checkpoint's step).
            if self.snapshots is not None and (self.snapshots.due(step) or background):
                self._snapshot(step, checkpoint=background)
            if stopping:
                if self.checkpointer is None:
                    log.warning("stopping at step %d without a checkpoint: no checkpoint_dir", step)
                log.info(
                    "stopped after step %d on %s; exit %d",
                    step,
                    # A rank that was not signalled stops on its peers' request (the agreement):
                    # it logged "on " with an empty name before (#40).
                    self.stop.signal_name or "a peer's stop request",
                    contract.EXIT_STOPPED,
                )
                self._finish_heartbeat()
                raise Stopped
        self._complete(total)

    def _wait_for_gate(self, step: int) -> None:
        while not self.stop.requested:
            try:
                if int(self._gate.read_text().strip() or 0) >= step:  # type: ignore[union-attr]
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.05)

    def report(self, loss: torch.Tensor | float, **fields: Any) -> float:
        """Publish this step's loss (a tensor: this rank's mean, averaged over the world here; a
        float: already the global mean) and any extra JSON fields; returns the global loss."""
        if isinstance(loss, torch.Tensor):
            where = collective_device(dist.get_backend(), self.device)  # a CPU loss over NCCL raised
            t = loss.detach().reshape(1).to(where, torch.float64)
            dist.all_reduce(t)
            value = float(t.item()) / self.world_size  # the one host synchronisation of a step
        else:
            value = float(loss)
        seconds = self.step_seconds
        m = self.metrics
        m.step.set(self.step)
        m.loss.set(value)
        record: dict[str, Any] = {
            "step": self.step,
            "loss": value,
            "world_size": self.world_size,
            "generation": self.generation,
            "in_place_restarts": self.in_place_restarts,
            "step_seconds": round(seconds, 6),
        }
        if self.sampler is not None:
            samples_per_s = self.sampler.global_batch_size / seconds
            m.samples_per_second.set(samples_per_s)
            record["samples_per_s"] = round(samples_per_s, 3)
        if self.device.type == "cuda":
            m.observe_gpu_memory(self.device)
        m.step_seconds.set(seconds)
        if self._first_step_time is None:
            self._first_step_time = time.time()
            m.first_step_time.set(self._first_step_time)
        if self._resumed_from is not None:
            record["resumed_from"], self._resumed_from = self._resumed_from, None
        record.update(fields)
        if isinstance(fields.get("lr"), (int, float)):
            m.learning_rate.set(fields["lr"])
        if isinstance(fields.get("tokens_per_s"), (int, float)):
            m.tokens_per_second.set(fields["tokens_per_s"])
        if isinstance(fields.get("mfu"), (int, float)):
            m.model_flops_utilization.set(fields["mfu"])
        if self.rank == 0:
            self._out.write(json.dumps(record) + "\n")
            self._out.flush()
        return value

    # -- checkpoints -------------------------------------------------------------------------------
    def save(self, step: int) -> Path | None:
        """Write the checkpoint of `step` now (every rank calls it); None without checkpoint_dir.
        A checkpoint being written in the background is published first (one write at a time)."""
        if self.checkpointer is None or self.state is None:
            return None
        if self.background is not None and self.snapshots is not None:
            # Every rank's threads done (the snapshot's starts the checkpoint's): every rank
            # collects the same outcomes.
            self.snapshots.wait()
            self.background.wait()
            for outcome in self.background.collect():
                self._background_saved(outcome)
        if step == self.last_saved_step:
            return None
        started = time.perf_counter()
        path = self.checkpointer.save(step, self.state, self._meta(step))
        self._saved(step, path, time.perf_counter() - started, time.time())
        return path

    def _snapshot(self, step: int, checkpoint: bool) -> None:
        """Take the snapshot of `step`; `checkpoint`: write it as the durable checkpoint of `step`
        too, on the snapshot's thread (checkpoint_background.py)."""
        assert self.snapshots is not None
        bg = self.background
        if self.state is None:
            return
        if checkpoint and bg is not None:
            self.snapshots.wait()  # its snapshot's thread may yet start the previous checkpoint's write
            bg.wait()  # one checkpoint write at a time
        then = bg.job(step) if checkpoint and bg is not None else None
        busy = bg is not None and bg.busy()
        taken = self.snapshots.take(step, self.state, self._meta(step), then=then, busy_elsewhere=busy)
        if taken and bg is not None and self.snapshots.idle_everywhere:
            # No snapshot nor checkpoint thread busy on any rank: the outcomes of the writes of
            # earlier steps are on every rank.
            for outcome in bg.collect(before=step):
                self._background_saved(outcome)

    def _background_saved(self, outcome: Outcome) -> None:
        if outcome.error is None:
            assert outcome.path is not None
            self._saved(outcome.step, outcome.path, outcome.seconds, outcome.time)
        else:
            self._save_failed(outcome.step, outcome.error)

    def _saved(self, step: int, path: Path, seconds: float, at: float) -> None:
        self.last_saved_step = step
        self.last_saved_time = at
        m = self.metrics
        self._failed_saves = 0
        m.checkpoint_write_failures.set(0)
        m.checkpoint_save_seconds.set(seconds)
        m.last_checkpoint_step.set(step)
        m.last_checkpoint_timestamp.set(self.last_saved_time)
        m.checkpoints_saved.inc()
        log.info("checkpoint %s written in %.2fs", path, seconds)

    def _meta(self, step: int) -> dict[str, Any]:
        """What a checkpoint (or snapshot) of `step` records beside the state."""
        return {
            "data": self.sampler.position(step + 1) if self.sampler is not None else {"next_step": step + 1},
            "config": self.config,
            "generation": self.generation,
            "time": time.time(),
        }

    def _save_or_go_on(self, step: int) -> None:
        """A periodic checkpoint that the volume refused (full, read-only, failing) costs only
        itself: the gang trains on (a restart would resume from the newest checkpoint) and tries
        again when the next one is due, and the operator shows the failures on the job
        (METRIC_CHECKPOINT_FAILURES). The last step's and a stop's checkpoints must be written:
        their failure ends the run."""
        try:
            self.save(step)
        except CheckpointWriteError as err:
            self._save_failed(step, err)

    def _save_failed(self, step: int, err: CheckpointWriteError) -> None:
        """A periodic checkpoint not written: see `_save_or_go_on`."""
        if not err.volume:
            raise err
        self._failed_saves += 1
        self.metrics.checkpoint_write_failures.set(self._failed_saves)
        newest = f"step {self.last_saved_step}" if self.last_saved_step > 0 else "none yet"
        log.warning(
            "checkpoint of step %d not written (%d in a row), training goes on (newest checkpoint: %s): %s",
            step,
            self._failed_saves,
            newest,
            err,
        )

    def failed(self, err: BaseException) -> None:
        """This rank is about to end with `err`. Its own failure: tell the gang at once (its dtjob
        collectives are broken and the heartbeat names it lost, so every peer exits 76 within
        seconds, #40). A peer that said it failed (GangAborted naming it): exit 76 naming it now.
        A peer gone without a word (a collective's connection closed): wait for the heartbeat to
        name the lost rank (the process then exits 76 naming it, so the operator replaces that
        rank's pod at once). Called by the built-in loop, and by the `sys.excepthook` the session
        installs for a user's script."""
        self._failing = True
        if isinstance(err, GangAborted) and err.failed_rank is not None and err.failed_rank != self.rank:
            heartbeat.leave_failed(err.failed_rank, str(err))
        if not heartbeat.is_peer_failure(err):
            abort.fail(err)
            if self.heartbeat is not None:
                self.heartbeat.fail()
            return
        if self.heartbeat is not None:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            log.error(
                "%s; waiting up to %.0fs for the heartbeat to name the lost rank",
                first,
                self.heartbeat.verdict_seconds,
            )
            self.heartbeat.await_verdict(lambda: self.stop.requested)

    def _excepthook(self, kind: type[BaseException], err: BaseException, tb: Any) -> None:
        self.failed(err)
        self._previous_excepthook(kind, err, tb)

    def _finish_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.finish()

    def _complete(self, total: int) -> None:
        """The operator reads this line from rank 0's log once it exited (dtjob.contract)."""
        self._finish_heartbeat()
        if self.snapshots is not None:
            self.snapshots.finish()  # the run is done: its snapshots are of no more use
        if self.last_saved_step > 0:
            log.info(contract.complete_line(total, self.last_saved_step, self.last_saved_time))
        else:
            log.info(contract.complete_line(total))

    def close(self) -> None:
        if self.snapshots is not None and not self._failing:
            # Its exchange must not outlive the process group. After a failure it may wait for a
            # lost peer (up to collective_timeout, 60 s): the process leaves without it instead.
            self.snapshots.wait()
            if self.background is not None:
                self.background.wait()
        if self.fence is not None:
            self.fence.close()
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        if self._out is not sys.stdout:
            self._out.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _seed_everything(self, seed: int) -> None:
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
