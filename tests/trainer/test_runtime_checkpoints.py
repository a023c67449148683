"""Checkpoints on disk, written by a real 2-process gang: retention keeps exactly K, and a truncated,
a flipped-byte and a manifest-less checkpoint are each skipped for the previous valid one (by a
1-process run, which also reads the 2-process shards back at another world size); a checkpoint
the volume refuses costs only itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dtjob.trainer import checkpoint as ckpt
from tests.trainer.runtime_gang import (
    TINY_GPT,
    checkpoint_steps,
    free_port_run,
    launch,
    run,
    scrape,
    wait_for,
)

pytestmark = pytest.mark.slow

# fmt: off
ARGS = [
    *TINY_GPT,
    "--global-batch-size", "4",
    "--checkpoint-every", "2",
    "--keep-checkpoints", "3",
    "--collective", "native",
]
# fmt: on


def test_retention_and_fallback_past_damaged_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = run(2, [*ARGS, "--steps", "8", "--checkpoint-dir", str(root)], tmp_path, "first")
    assert checkpoint_steps(root) == [4, 6, 8], "retention must keep exactly the newest 3"
    manifest = json.loads((root / "step-00000008" / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"]) == (8, 2)
    assert manifest["data"]["next_step"] == 9 and manifest["config"]["steps"] == 8
    # The learning-rate scheduler is saved (by rank 0) and read back on resume.
    import torch

    shared = torch.load(root / "step-00000008" / "rank-00000.pt", weights_only=True)["global_state"]
    assert shared["scheduler"]["last_epoch"] == 8
    assert sorted(manifest["files"]) == ["rank-00000.pt", "rank-00001.pt"]
    assert any(key.startswith("optim.") for key in manifest["tensors"])
    assert not list(root.glob(".staging-*")), "staging directories must not outlive a save"

    # Damage the three newest candidates, each differently.
    flipped = root / "step-00000008" / "rank-00001.pt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = root / "step-00000006" / "rank-00000.pt"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    shutil.copytree(root / "step-00000004", root / "step-00000010")
    (root / "step-00000010" / "manifest.json").unlink()

    second = run(1, [*ARGS, "--steps", "10", "--checkpoint-dir", str(root)], tmp_path, "second")
    warnings = second.stderr(0)
    for name, reason in [("10", "no manifest.json"), ("8", "sha256 mismatch"), ("6", "bytes, manifest says")]:
        assert f"skipping checkpoint {root}/step-000000{name.zfill(2)}: " in warnings, warnings
        assert reason in warnings
    resumed = {s["step"]: s["loss"] for s in second.steps()}
    assert sorted(resumed) == [5, 6, 7, 8, 9, 10], "must resume after the newest valid checkpoint, step 4"
    original = {s["step"]: s["loss"] for s in first.steps()}
    for step in (5, 6, 7, 8):  # the same trajectory, up to the order of floating-point sums
        assert resumed[step] == pytest.approx(original[step], rel=1e-5)

    assert checkpoint_steps(root) == [6, 8, 10]
    for step in (6, 8, 10):
        ckpt.verify(root / ckpt.step_dir_name(step))  # the damaged ones were rewritten whole


def test_a_checkpoint_the_volume_refuses_costs_only_itself(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    gate = tmp_path / "gate"
    gate.write_text("4")
    port = free_port_run(2)
    args = [*ARGS, "--steps", "12", "--checkpoint-dir", str(root), "--metrics-port", str(port)]
    gang = launch(2, args, tmp_path, "full", env={"DTJOB_STEP_GATE": str(gate)})
    try:
        wait_for(lambda: [s["step"] for s in gang.steps()][-1:] == [4], "the gang held at step 4")
        # Rank 1's file of step 6 goes to the kernel's full device: ENOSPC, as on a full volume.
        staging = root / ".staging-step-00000006-g0"
        staging.mkdir()
        (staging / "rank-00001.pt.tmp").symlink_to("/dev/full")
        gate.write_text("7")
        seen: dict[str, float] = {}

        def past_step_6() -> bool:
            seen.update(scrape(port) or {})
            return seen.get("dtjob_trainer_step", 0) >= 7

        wait_for(past_step_6, "rank 0 at step 7")
        assert seen["dtjob_trainer_checkpoint_write_failures"] == 1
        assert seen["dtjob_trainer_last_checkpoint_step"] == 4, "the newest checkpoint stays step 4"
        gate.write_text("12")
        codes = gang.wait()
    finally:
        gang.kill()
    assert codes == [0, 0], gang.stderr()
    assert [s["step"] for s in gang.steps()] == list(range(1, 13)), "no step lost or repeated"
    assert checkpoint_steps(root) == [8, 10, 12]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "nothing of the attempt left"
    warning = "checkpoint of step 6 not written (1 in a row), training goes on (newest checkpoint: step 4)"
    for rank in (0, 1):
        assert warning in gang.stderr(rank), gang.stderr(rank)
    assert "rank 1: OSError: [Errno 28] No space left on device" in gang.stderr(0)
