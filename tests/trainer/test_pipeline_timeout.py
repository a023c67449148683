"""A hung peer inside a pipeline's subgroup is found within the job's collective timeout.

The subgroups (one per pipeline, per stage's replicas, per tied weight) must carry the default
group's timeout: `dist.new_group()` without one waits torch's default, 30 minutes on gloo.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.slow

TIMEOUT_S = 5.0  # the job's collective timeout in this test
SLACK_S = 5.0  # the bound: found within the timeout + 5 s
HANG_S = 3 * TIMEOUT_S  # how long stage 1 stays away: past the bound, then it comes back


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timeout)
    from dtjob.trainer.models import MLP, MLPConfig
    from dtjob.trainer.parallel import pipeline

    torch.manual_seed(0)
    model = MLP(MLPConfig(inputs=12, hidden=24, classes=6, depth=4))
    pipe = pipeline(model, stages=2, microbatches=2, collective="native")
    x, y = torch.randn(8, 12), torch.randint(0, 6, (8,))
    pipe.step(x, y)  # both stages work: the pipeline is up
    result: dict[str, Any] = {}
    if rank == 1:
        time.sleep(HANG_S)  # stage 1 hangs; its pipeline group's all-reduce below waits for it
    start = time.monotonic()
    try:
        # The gradient norm sums over the pipeline's group (clip.py): a collective of that subgroup.
        torch.nn.utils.clip_grad_norm_(pipe.parameters(), 1.0)
        result["raised"] = None
    except RuntimeError as err:
        result["raised"] = str(err).splitlines()[0]
    result["seconds"] = time.monotonic() - start
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    os._exit(0)  # the group is broken: no destroy_process_group, which could wait on it


def test_hung_stage_is_found_within_the_collective_timeout() -> None:
    with tempfile.TemporaryDirectory(prefix="dtjob-pp-timeout-") as out:
        ctx = multiprocessing.get_context("spawn")
        store = os.path.join(out, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, store, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            if p.is_alive():
                p.kill()
        found = torch.load(os.path.join(out, "rank0.pt"))
    assert found["raised"] is not None, (
        f"stage 0 waited {found['seconds']:.1f}s for the hung stage and did not raise"
    )
    assert found["seconds"] <= TIMEOUT_S + SLACK_S, found
    print(f"stage 0 found the hung stage after {found['seconds']:.2f}s: {found['raised']}")
