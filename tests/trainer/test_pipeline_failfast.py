"""Fail fast in a pipeline (issue #40): a stage raising at step 2 makes its peer stage raise within
10 s, while the failed process lingers with its sockets open. Real processes, a real gloo group,
the user's loop of pipeline_failfast_worker.py. The peer waits in the pipeline's point-to-point
messages (a header on the control group, or activations and gradients), not in a collective."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.trainer.runtime_gang import REPO, launch, wait_for

pytestmark = pytest.mark.slow

WORKER = [str(REPO / "tests" / "trainer" / "pipeline_failfast_worker.py")]
BOUND_S = 10.0  # the bound
LINGER_S = "60"  # the failed process stays this long: its sockets stay open


@pytest.mark.parametrize("fail_rank", [0, 1], ids=["first-stage-fails", "last-stage-fails"])
def test_a_stage_raising_at_step_2_makes_its_peer_raise_within_10s(tmp_path: Path, fail_rank: int) -> None:
    # Stage 0 failing: stage 1 waits for an activation's header. Stage 1 failing: stage 0 waits for
    # gradients. Both waited until the failed process exited (here 60 s) before.
    args = ["--fail-rank", str(fail_rank), "--out", str(tmp_path), "--linger", LINGER_S]
    gang = launch(2, args, tmp_path, f"pp-failfast-{fail_rank}", command=WORKER)
    peer = 1 - fail_rank
    try:
        wait_for(lambda: (tmp_path / "failed").exists(), f"rank {fail_rank} failing", timeout=120)
        raised = tmp_path / f"raised-{peer}"
        deadline = time.monotonic() + float(LINGER_S) - 15
        while not raised.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raised.exists(), f"rank {peer} still waits after rank {fail_rank} failed\n{gang.stderr()}"
        delay = float(raised.read_text()) - float((tmp_path / "failed").read_text())
        print(f"pipeline fail-fast: rank {peer} raised {delay:.2f}s after rank {fail_rank} raised")
        assert delay < BOUND_S, gang.stderr()
        wait_for(lambda: gang.procs[peer].poll() is not None, f"rank {peer} exiting", timeout=30)
        said = f"rank {fail_rank} failed (RuntimeError: stage {fail_rank} fails at step 2)"
        assert said in gang.stderr(peer), gang.stderr(peer)
    finally:
        gang.kill()
