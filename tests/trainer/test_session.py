"""ElasticSession in a user's own script (examples/vision-ddp/train.py, plain PyTorch + data_parallel):
SIGTERM mid-run checkpoints on every rank and exits 75; the run resumed at another world size
continues the uninterrupted run's loss trajectory; full_state_dict loads into a fresh model."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.runtime_gang import REPO, checkpoint_steps, launch, run, wait_for

pytestmark = pytest.mark.slow

SCRIPT = [str(REPO / "examples" / "vision-ddp" / "train.py")]
STEPS = 24


def _losses(gang_steps: list[dict[str, object]]) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in gang_steps}  # type: ignore[arg-type]


def test_sigterm_exits_75_and_a_resume_at_another_world_size_continues_the_trajectory(tmp_path: Path) -> None:
    args = ["--steps", str(STEPS), "--global-batch-size", "24", "--checkpoint-every", "100"]
    reference = run(
        2, args, tmp_path, "reference", command=SCRIPT, env={"DTJOB_CHECKPOINT_DIR": str(tmp_path / "ref")}
    )
    want = _losses(reference.steps())
    assert sorted(want) == list(range(1, STEPS + 1))

    checkpoints = tmp_path / "ckpt"
    env = {"DTJOB_CHECKPOINT_DIR": str(checkpoints)}
    # Held at step 6 by the step gate (24 steps take under a second: a SIGTERM sent after six
    # were seen once arrived when all were done). Rank 1 told goes on to step 7 at once, rank 0
    # once the gate opens; after it every rank stops.
    gate = tmp_path / "gate"
    gate.write_text("6")
    first = launch(2, args, tmp_path, "first", env={**env, "DTJOB_STEP_GATE": str(gate)}, command=SCRIPT)
    wait_for(lambda: len(first.steps()) >= 6, "six steps")
    first.signal(1, signal.SIGTERM)  # one rank told; every rank stops after the same step
    gate.write_text(str(STEPS))
    assert first.wait() == [75, 75], first.stderr()
    # The rank not signalled names why it stopped (#40: it logged "stopped after step 7 on ; exit 75").
    assert "stopped after step 7 on SIGTERM; exit 75" in first.stderr(1), first.stderr(1)
    assert "stopped after step 7 on a peer's stop request; exit 75" in first.stderr(0), first.stderr(0)
    [stopped_at] = checkpoint_steps(checkpoints)
    assert stopped_at == 7
    manifest = json.loads((checkpoints / f"step-{stopped_at:08d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and sorted(manifest["files"]) == ["rank-00000.pt", "rank-00001.pt"]

    resumed = run(3, args, tmp_path, "resumed", env=env, command=SCRIPT)
    got = _losses(resumed.steps())
    assert sorted(got) == list(range(stopped_at + 1, STEPS + 1))  # no step lost or repeated
    for step, loss in got.items():
        assert loss == pytest.approx(want[step], rel=1e-5), f"step {step}"

    sys.path.insert(0, str(REPO / "examples" / "vision-ddp"))
    from train import Net  # type: ignore[import-not-found]

    final = torch.load(checkpoints / "final.pt")
    fresh = Net()
    fresh.load_state_dict(final["weights"])  # strict: every key, original names
    assert torch.allclose(fresh(final["probe"]), final["outputs"], atol=1e-6)
    reference_final = torch.load(tmp_path / "ref" / "final.pt")["weights"]
    for key, value in reference_final.items():
        assert torch.allclose(final["weights"][key], value, rtol=1e-4, atol=1e-6), key


def test_a_peer_killed_mid_collective_ends_a_users_script_with_the_lost_rank_named(tmp_path: Path) -> None:
    """The survivor's all-reduce fails at once (gloo: the connection closed); the session's
    excepthook holds the error until the heartbeat names rank 1, so the script exits 76 (the
    operator then replaces that rank's pod at once, even on a node that looks alive)."""
    args = ["--steps", "1000000", "--global-batch-size", "24", "--checkpoint-every", "0"]
    gang = launch(2, args, tmp_path, "killed", command=SCRIPT, env={"DTJOB_HEARTBEAT_TIMEOUT": "4"})
    code = gang.kill_rank_1_after_three_steps()
    assert code == 76, gang.stderr(0)
    assert "waiting up to 5s for the heartbeat" in gang.stderr(0), gang.stderr(0)
    assert "peer lost: rank 1 silent for" in gang.stderr(0)
