"""A user's training loop with a 2-stage pipeline, for test_pipeline_failfast.py (issue #40).

    pipeline_failfast_worker.py --fail-rank R --out DIR [--linger S] --log-file F

Both ranks train a small MLP cut into 2 stages under a plain `dist.init_process_group`. At step 2
a layer of rank R's stage raises inside its forward (after writing DIR/failed: the time); the
other rank, waiting for that stage's activations or gradients, writes DIR/raised-<rank> (the time)
when its step raises. --linger S: the failed rank stays S seconds in atexit before its process
ends, its sockets open, so its peer learns of the failure only from dtjob's abort.
"""

from __future__ import annotations

import argparse
import atexit
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtjob.trainer.parallel import pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--log-file", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    pipe = pipeline(model, stages=2, microbatches=2, split=["2"])
    at = {"step": 0}

    def fail(_module: nn.Module, _inputs: Any, _output: Any) -> None:
        step = at["step"]
        if step == 2 and rank == args.fail_rank:
            if args.linger:
                atexit.register(time.sleep, args.linger)
            (args.out / "failed").write_text(repr(time.time()))
            raise RuntimeError(f"stage {rank} fails at step {step}")

    # The failing rank's own layer: "0" runs on stage 0, "4" on stage 1.
    model.get_submodule("0" if args.fail_rank == 0 else "4").register_forward_hook(fail)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    try:
        for step in range(1, 1_000_000):
            at["step"] = step
            pipe.step(torch.randn(8, 8), torch.randint(0, 4, (8,)))
            optimizer.step()
            optimizer.zero_grad()
    except BaseException:
        if rank != args.fail_rank:
            (args.out / f"raised-{rank}").write_text(repr(time.time()))
        raise


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
