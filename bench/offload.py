"""ZeRO-Offload's step-time cost: fully_shard(zero_stage=3) with and without offload="optimizer"
on the same model, CPU, gloo, world 2 (issue #44).

    python bench/offload.py                 # width 512, 4 MLP blocks, 5 runs of 10 timed steps
    python bench/offload.py --runs 8 --width 1024

A step is forward, backward, AdamW and zero_grad. The two models train side by side, step by
step, so the machine's load drifts over both alike; each run's median step time is taken, and
the table gives the median over runs and each run's ratio (offload / device). On a CPU-only
machine the "host" is the device: the cost measured is offload's bookkeeping and copies (the
master shard copied to the device shard, the gradient shard to the host), not PCIe transfers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer_image"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tp import build  # noqa: E402  (bench/tp.py: the same MLP blocks)

VARIANTS = {"device": None, "offload": "optimizer"}


def _worker(rank: int, args: Any, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rv", rank=rank, world_size=args.world)
    from dtjob.trainer.parallel import fully_shard

    models = {
        name: fully_shard(build(args.width, args.depth), zero_stage=3, offload=offload, collective="ring")
        for name, offload in VARIANTS.items()
    }
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1) for k, m in models.items()}
    x = torch.randn(args.batch, args.seq, args.width)
    medians: dict[str, list[float]] = {k: [] for k in models}
    for _run in range(args.runs):
        times: dict[str, list[float]] = {k: [] for k in models}
        for step in range(args.warmup + args.steps):
            for name, model in models.items():
                dist.barrier()
                start = time.perf_counter()
                model(x).pow(2).mean().backward()
                optims[name].step()
                optims[name].zero_grad()
                dist.barrier()
                if step >= args.warmup:
                    times[name].append(time.perf_counter() - start)
        for name, ts in times.items():
            medians[name].append(statistics.median(ts))
    if rank == 0:
        params = sum(p.numel() for p in build(args.width, args.depth).parameters())
        ratios = [o / d for o, d in zip(medians["offload"], medians["device"], strict=True)]
        for name, ms in medians.items():
            print(
                f"{name:8s} median step {statistics.median(ms) * 1e3:8.2f} ms  runs: "
                + " ".join(f"{m * 1e3:.1f}" for m in ms)
            )
        print(
            f"offload / device: median {statistics.median(ratios):.3f}, runs "
            + " ".join(f"{r:.3f}" for r in ratios)
        )
        result = {
            "world": args.world,
            "params": params,
            "width": args.width,
            "depth": args.depth,
            "batch": args.batch,
            "seq": args.seq,
            "steps": args.steps,
            "runs": args.runs,
            "median_step_s": {k: statistics.median(v) for k, v in medians.items()},
            "run_medians_s": medians,
            "ratios": ratios,
            "torch": torch.__version__,
        }
        (ROOT / "bench" / "results" / "offload.json").write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(args, out), nprocs=args.world)


if __name__ == "__main__":
    main()
