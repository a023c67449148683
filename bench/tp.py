"""Tensor parallelism: samples/s of dtjob's `tensor_parallel` against torch's `parallelize_module`
(ColwiseParallel / RowwiseParallel) with the same plan on the same model, CPU, gloo, TP=2.

    python bench/tp.py                 # width 512, 4 MLP blocks, 20 timed steps each
    python bench/tp.py --steps 40 --width 1024

The model is a stack of pre-norm MLP blocks (x + down(gelu(up(ln(x))))): up colwise, down
rowwise, one all-reduce per block in forward and one in backward for both implementations. A
step is forward, backward and AdamW. The implementations are timed interleaved, step by step,
so the machine's load drifts over both alike; the numbers are medians over the steps.
"""

from __future__ import annotations

import argparse
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
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(depth)))


def _worker(rank: int, args: Any, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rv", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    from dtjob.trainer import tensor_parallel

    plan = {"*.up": "colwise", "*.down": "rowwise"}
    mesh = init_device_mesh("cpu", (2,))
    torch_plan: dict[str, ParallelStyle] = {
        f"{i}.{name}": style
        for i in range(args.depth)
        for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))
    }
    models: dict[str, nn.Module] = {
        "dtjob": tensor_parallel(build(args.width, args.depth), plan),
        "dtjob-native": tensor_parallel(build(args.width, args.depth), plan, collective="native"),
        "torch": parallelize_module(build(args.width, args.depth), mesh, torch_plan),
    }
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randn(args.batch, args.seq, args.width)
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
    if rank == 0:
        for name, ts in times.items():
            median = statistics.median(ts)
            print(f"{name:13s} median step {median * 1e3:8.2f} ms  {args.batch / median:8.1f} samples/s")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(args, out), nprocs=2)


if __name__ == "__main__":
    main()
