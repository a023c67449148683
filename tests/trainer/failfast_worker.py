"""A user's training loop with data_parallel, for the fail-fast tests (test_failfast.py, issue #40).

    failfast_worker.py plain|session --fail raise|stall --fail-rank R --out DIR [--linger S]

Every rank trains a small MLP under `data_parallel`, under a plain `dist.init_process_group` or
`ElasticSession`. At step 2, rank R either raises (after writing DIR/failed: the time) or stalls
before its step's collective (after writing DIR/stalled; the test then SIGKILLs it). A rank whose
loop raises writes DIR/raised-<rank> (the time) first. --linger S: the rank that fails stays S
seconds in atexit before its process ends (as a logger's upload or a profiler's dump does), so
its sockets stay open: a peer learns of the failure only from dtjob's abort; with
--survivors-linger every rank that raised does too.
"""

from __future__ import annotations

import argparse
import atexit
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dtjob.trainer.parallel import data_parallel
from dtjob.trainer.session import ElasticSession


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["plain", "session"])
    parser.add_argument("--fail", choices=["raise", "stall"], required=True)
    parser.add_argument("--fail-rank", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--survivors-linger", action="store_true")
    parser.add_argument("--log-file", default=None)
    args = parser.parse_args()
    session = None
    if args.mode == "session":
        session = ElasticSession(checkpoint_dir="", metrics_port=0, log_file=args.log_file)
        rank = session.rank
    else:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = data_parallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = session.steps(1_000_000) if session is not None else iter(range(1, 1_000_000))
    try:
        for step in steps:
            if step == 2 and rank == args.fail_rank:
                if args.linger:
                    atexit.register(time.sleep, args.linger)
                if args.fail == "raise":
                    (args.out / "failed").write_text(repr(time.time()))
                    raise RuntimeError(f"rank {rank} fails at step {step}")
                (args.out / "stalled").write_text(repr(time.time()))
                time.sleep(3600)  # SIGKILLed here
            loss = model(torch.randn(8, 32)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except BaseException:
        if rank != args.fail_rank:
            (args.out / f"raised-{rank}").write_text(repr(time.time()))
            if args.survivors_linger:
                atexit.register(time.sleep, args.linger)
        raise


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
