"""A restart in place that redoes nothing: test_runtime_in_place.py's gang (two `python -m
dtjob.trainer` processes, each under its pod agent, checkpoints every 4 steps, one trainer
SIGKILLed after step 6) with in-memory snapshots on, each pod with its own snapshot directory.
The new trainers resume from memory at step 6, not from the step-4 checkpoint: no step is logged
twice, and the trajectory is the reference run's."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest

from dtjob import contract
from tests.trainer.runtime_gang import Gang, launch, wait_for
from tests.trainer.test_runtime_in_place import ARGS, REL_TOL, _standbys, _trainers
from tests.trainer.test_runtime_in_place import _agents as pod_agents

pytestmark = pytest.mark.slow


def _agents(tmp_path: Path, args: list[str]) -> Gang:
    """test_runtime_in_place's two pod agents, snapshots every step in each pod's directory."""
    return pod_agents(
        tmp_path,
        args,
        pod_env=lambda pod: {
            contract.ENV_SNAPSHOT_EVERY: "1",
            contract.ENV_SNAPSHOT_DIR: str(tmp_path / f"memory-of-pod-{pod}"),
        },
    )


def test_a_killed_trainer_restarted_in_place_resumes_from_memory_and_redoes_no_step(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.write_text("6")
    agents = _agents(tmp_path, [*ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"), "--step-gate", str(gate)])
    reference = launch(1, [*ARGS, "--checkpoint-dir", str(tmp_path / "ref")], tmp_path, "reference")
    try:
        wait_for(lambda: any(s["step"] == 6 for s in agents.steps()), "step 6")
        pids = [p.pid for p in agents.procs]
        # Step 6's snapshot (and its buddy copy) is in both pods' memory before the kill.
        memory = [tmp_path / f"memory-of-pod-{pod}" for pod in (0, 1)]
        wait_for(
            lambda: all(len(list(m.glob("run-*/step-00000006/*.json"))) == 2 for m in memory),
            "step 6's snapshot and buddy copy in both pods",
        )
        wait_for(lambda: all(len(_standbys(pid, ready=True)) == 1 for pid in pids), "both standbys ready")
        victim = _trainers(pids[1])
        assert len(victim) == 1
        os.kill(victim[0], signal.SIGKILL)
        wait_for(lambda: "restart in place 1" in agents.stderr(0), "the restart in place")
        gate.write_text("12")
        codes = agents.wait()
        assert codes == [0, 0], agents.stderr()
        assert reference.wait() == [0], reference.stderr()
    finally:
        for agent in agents.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
        agents.kill()
        reference.kill()

    steps = [int(s["step"]) for s in agents.steps()]
    assert steps == list(range(1, 13)), steps  # test_runtime_in_place.py redoes 5 and 6
    assert "resumed from host memory" in agents.stderr(0), agents.stderr(0)
    want = {int(s["step"]): float(s["loss"]) for s in reference.steps()}
    for record in agents.steps():
        step, loss = int(record["step"]), float(record["loss"])
        assert loss == pytest.approx(want[step], rel=REL_TOL), f"step {step}"
