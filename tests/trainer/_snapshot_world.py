"""Gangs of ElasticSession processes over per-pod snapshot directories, for tests/trainer/test_snapshots.py.

`run_gang(world, pod_size, case, tmp)` starts `world` processes (forkserver, as _parallel_harness's
World), each an ElasticSession joined at a free port of 127.0.0.1 with the environment a pod's
launcher gives it (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, DTJOB_SNAPSHOT_DIR = its pod's directory).
Each trains a model no other test uses (a small residual MLP regressor, SGD with momentum and a
StepLR, both in the snapshot) in a user's loop, and returns per rank: the step it resumed at, the
global loss of each step, and the session's log lines. case["die_after"] = k ends every process
after step k (at step k + 1's start, once step k's snapshot is written) with os._exit: no stop, no
checkpoint, nothing the session does on the way out; what the pod's agent sees when it restarts
the trainers in place.
case["also_save"] = a directory: at step k, before dying, write a durable checkpoint of step k
there too (the yardstick of a resume "from a checkpoint at that step").
case["hold_checkpoint"] = k: the background write of the checkpoint of step k (its rank file)
blocks until step k + 2 is done, and the loop does not wait for snapshots: result["published"]
says whether step k's checkpoint directory existed then (it must not: the steps ran meanwhile).
Each rank's result also has its snapshot and resume gauges ("gauges", read at the end).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from tests.trainer.runtime_gang import free_port

STEPS = 12
GLOBAL_BATCH = 8


class ResidualRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 20)
        self.mid = nn.Sequential(nn.LayerNorm(20), nn.Linear(20, 20), nn.Tanh())
        self.out = nn.Linear(20, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.mid(h))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global step `step`'s samples, the same at any world size."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g)
    return x, torch.sin(x[:, :3]) + 0.1 * torch.randn(GLOBAL_BATCH, 3, generator=g)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(rank: int, case: dict[str, Any], out: Path) -> dict[str, Any]:
    from dtjob.trainer.checkpoint import Checkpointer
    from dtjob.trainer.parallel import data_parallel, fully_shard
    from dtjob.trainer.session import ElasticSession

    lines = _Lines()
    logger = logging.getLogger("dtjob")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    session = ElasticSession(
        checkpoint_dir=case["checkpoint_dir"],
        checkpoint_every=case.get("checkpoint_every", 5),
        metrics_port=0,
        snapshot_every=case.get("snapshot_every", 1),
        log_file=str(out / "steps.jsonl"),
    )
    torch.manual_seed(0)
    model = ResidualRegressor()
    wrapped = data_parallel(model) if case["strategy"] == "ddp" else fully_shard(model, zero_stage=3)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    session.track(wrapped, optimizer, scheduler)
    session.resume()
    result: dict[str, Any] = {"start": session.start_step, "losses": {}, "lines": lines.lines}
    held = _hold_checkpoint(case.get("hold_checkpoint"))
    per = GLOBAL_BATCH // session.world_size
    for step in session.steps(case.get("steps", STEPS)):
        if step - 1 == case.get("die_after"):  # step k is done: snapshot taken
            assert session.snapshots is not None
            session.snapshots.wait()  # the snapshot of step k is everywhere, as the test wants
            if case.get("also_save"):
                Checkpointer(Path(case["also_save"]), rank, session.world_size, 0, 3, session.group).save(
                    step - 1,
                    session.state,
                    session._meta(step - 1),  # type: ignore[arg-type]
                )
            result["snapshots"] = {"taken": session.snapshots.taken, "skipped": session.snapshots.skipped}
            result["gauges"] = _gauges(session)
            torch.save(result, out / f"rank{rank}.pt")
            logging.shutdown()
            os._exit(0)
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = torch.nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        result["losses"][step] = session.report(loss)
        if held is not None and step == case["hold_checkpoint"] + 2:
            result["published"] = (Path(case["checkpoint_dir"]) / f"step-{step - 2:08d}").exists()
            held.set()
        if session.snapshots is not None and held is None:
            # These steps take a millisecond: wait for the previous snapshot as a step longer than
            # its write would, so none is skipped and the one of step k exists when they die.
            session.snapshots.wait()
    if session.snapshots is not None:
        result["snapshots"] = {"taken": session.snapshots.taken, "skipped": session.snapshots.skipped}
    session.close()
    result["gauges"] = _gauges(session)
    return result


_GAUGES: dict[str, tuple[str, dict[str, str]]] = {
    "resume_lost_step": ("dtjob_trainer_resume_lost_step", {}),
    "resumed_step": ("dtjob_trainer_resumed_step", {}),
    "last_checkpoint_step": ("dtjob_trainer_last_checkpoint_step", {}),
    "snapshot_step": ("dtjob_trainer_snapshot_step", {}),
    "snapshot_seconds": ("dtjob_trainer_snapshot_seconds", {}),
    "own_bytes": ("dtjob_trainer_snapshot_bytes", {"copy": "own"}),
    "buddy_bytes": ("dtjob_trainer_snapshot_bytes", {"copy": "buddy"}),
}


def _gauges(session: Any) -> dict[str, float | None]:
    return {key: session.metrics.registry.get_sample_value(n, labels) for key, (n, labels) in _GAUGES.items()}


def _hold_checkpoint(step: int | None) -> threading.Event | None:
    """Block the background write of the checkpoint of `step` until the returned event is set."""
    if step is None:
        return None
    from dtjob.trainer import checkpoint_background

    release = threading.Event()
    write = checkpoint_background.write_rank_bytes

    def held(directory: Path, name: str, *rest: Any) -> Any:
        if directory.name.startswith(f".staging-step-{step:08d}-"):
            release.wait()
        return write(directory, name, *rest)

    checkpoint_background.write_rank_bytes = held  # type: ignore[assignment]
    return release


def _worker(rank: int, world: int, pod_size: int, port: int, case: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % pod_size),
            "LOCAL_WORLD_SIZE": str(pod_size),
            "DTJOB_JOB_UID": case.get("uid", "snapshot-test"),
            "DTJOB_HEARTBEAT_TIMEOUT": "0",
            "DTJOB_SNAPSHOT_DIR": case["pods"][rank // pod_size],
        }
    )
    try:
        result = _train(rank, case, out)
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, out / f"rank{rank}.pt")


def run_gang(
    world: int, pod_size: int, case: dict[str, Any], out: Path, timeout: float = 300
) -> list[dict[str, Any]]:
    """Run `case` in a gang of `world` processes, `pod_size` per pod; each rank's result."""
    out.mkdir(parents=True)
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed", __name__])
    ctx = mp.start_processes(
        _worker,
        args=(world, pod_size, free_port(), case, str(out)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"gang of {world} did not finish within {timeout}s")
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, result in enumerate(results):
        assert "error" not in result, f"rank {r}: {result['error']}"
    return results
