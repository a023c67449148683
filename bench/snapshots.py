"""The per-step cost of in-memory snapshots (trainer/snapshot.py) in an ElasticSession loop.

    python bench/snapshots.py [--world 2] [--steps 40] [--width 256] [--depth 4] [--device cpu]

Gangs of `world` processes (one per pod, so every rank sends a buddy copy) train dtjob's GPT
(data_parallel, AdamW), with snapshots every step and without (snapshot_every 1 / 0), one gang
each, alternating `--repeats` times so load drifts on a shared machine hit both alike. A step's
time is from one `steps()` yield to the next: the user's forward, backward and optimizer step,
plus the session's own work after it (the stop agreement; the snapshot's agreement and host
copy; its write and exchange run on a thread).
Reports the median step time of each side (steps after the first 5), the overhead, the state's
bytes per rank, the snapshots taken and skipped (skipped: the previous was still being
written), and the median seconds the thread took for one (serialize, write, exchange). Writes
bench/results/snapshots.json.

    python bench/snapshots.py --checkpoint-every 5 [--out bench/results/checkpoint_stall.json]

The stall of a durable checkpoint instead: both sides take snapshots every step and a checkpoint
every 5 steps, written by the step ("sync", ElasticSession(checkpoint_in_background=False)) or
from the snapshot on its thread ("background", the default). Reports each side's median time of
the steps that wrote a checkpoint and of the others; the stall is their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from dtjob.devcluster.host import free_port
from dtjob.trainer.snapshot import host_bytes

WARMUP = 5


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "DTJOB_HEARTBEAT_TIMEOUT": "0",
            "DTJOB_SNAPSHOT_DIR": os.path.join(out, f"pod{rank}"),
            "DTJOB_JOB_UID": "bench",
        }
    )
    from dtjob.trainer.models import GPT, GPTConfig
    from dtjob.trainer.parallel import data_parallel
    from dtjob.trainer.session import ElasticSession

    session = ElasticSession(
        checkpoint_dir=os.path.join(out, "ckpt"),
        checkpoint_every=args.get("checkpoint_every", 0),
        checkpoint_in_background=args.get("background", True),
        metrics_port=0,
        device=args["device"],
        snapshot_every=args["every"],
        log_file=os.path.join(out, "steps.jsonl"),
    )
    torch.manual_seed(0)
    config = GPTConfig(vocab=256, width=args["width"], depth=args["depth"], heads=4, seq_len=64)
    model = data_parallel(GPT(config).to(session.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    session.track(model, optimizer)
    times: list[float] = []
    at_checkpoint: list[float] = []  # the steps that wrote (or started) a checkpoint
    last = None
    for step in session.steps(args["steps"]):
        now = time.perf_counter()
        if last is not None and step > WARMUP + 1:
            every = args.get("checkpoint_every", 0)
            # From the previous yield to this one: step - 1 and the session's work after it.
            (at_checkpoint if every and (step - 1) % every == 0 else times).append(now - last)
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 256, (args["batch"] // world, 64), generator=g).to(session.device)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        session.report(loss)
        last = now
    snaps = session.snapshots
    result = {
        "times": times,
        "at_checkpoint": at_checkpoint,
        "params": sum(p.numel() for p in model.parameters()),
        "own_bytes": snaps.own_bytes if snaps else 0,
        "taken": snaps.taken if snaps else 0,
        "skipped": snaps.skipped if snaps else 0,
        "write_seconds": statistics.median(snaps.write_seconds) if snaps and snaps.write_seconds else 0.0,
    }
    session.close()
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def _gang(world: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="dtjob-bench-snapshots-") as out:
        mp.start_processes(_worker, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
        return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--out", default=None)
    a = parser.parse_args()
    base = {"steps": a.steps, "width": a.width, "depth": a.depth, "batch": a.batch, "device": a.device}
    if a.checkpoint_every:
        report = _stall(a, {**base, "checkpoint_every": a.checkpoint_every, "every": 1})
        _write(report, a.out or str(Path(__file__).parent / "results" / "checkpoint_stall.json"))
        return
    sides: dict[str, list[float]] = {"off": [], "on": []}
    info: dict[str, Any] = {}
    buddy = 0
    for _ in range(a.repeats):
        for side, every in (("off", 0), ("on", 1)):
            ranks = _gang(a.world, {**base, "every": every})
            sides[side] += ranks[0]["times"]
            if side == "on":
                info = {k: ranks[0][k] for k in ("params", "own_bytes", "taken", "skipped", "write_seconds")}
                buddy = ranks[-1]["own_bytes"] if a.world > 1 else 0  # rank 0 keeps rank world-1's copy
    off, on = statistics.median(sides["off"]), statistics.median(sides["on"])
    report = {
        "world": a.world,
        "device": a.device,
        "model": f"GPT width {a.width} depth {a.depth}",
        **info,
        "median_step_seconds_off": round(off, 5),
        "median_step_seconds_on": round(on, 5),
        "buddy_bytes": buddy,
        # snapshot.host_bytes: the most host memory rank 0's snapshots take (2 held + 1 in flight)
        "host_bytes_per_rank": host_bytes(int(info.get("own_bytes", 0)), buddy),
        "overhead": round(on / off - 1, 4),
        "steps_timed_per_side": len(sides["on"]),
        "load_average": os.getloadavg()[0],
    }
    _write(report, a.out or str(Path(__file__).parent / "results" / "snapshots.json"))


def _stall(a: argparse.Namespace, args: dict[str, Any]) -> dict[str, Any]:
    """Median step times at a checkpoint and between, written by the step or in the background."""
    sides: dict[str, dict[str, list[float]]] = {}
    for _ in range(a.repeats):
        for side, background in (("sync", False), ("background", True)):
            rank0 = _gang(a.world, {**args, "background": background})[0]
            got = sides.setdefault(side, {"at_checkpoint": [], "other": []})
            got["at_checkpoint"] += rank0["at_checkpoint"]
            got["other"] += rank0["times"]
    report: dict[str, Any] = {
        "world": a.world,
        "device": a.device,
        "model": f"GPT width {a.width} depth {a.depth}",
        "checkpoint_every": a.checkpoint_every,
    }
    for side, got in sides.items():
        at, other = statistics.median(got["at_checkpoint"]), statistics.median(got["other"])
        report[side] = {
            "median_step_seconds_at_checkpoint": round(at, 5),
            "median_step_seconds_other": round(other, 5),
            "stall_seconds": round(at - other, 5),
            "checkpoint_steps_timed": len(got["at_checkpoint"]),
        }
    report["load_average"] = os.getloadavg()[0]
    return report


def _write(report: dict[str, Any], out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
