"""Durable checkpoints written in the background from the snapshot (checkpoint_background.py), in a
real ZeRO-3 gang of 2 ElasticSession processes (2 pods of 1, _snapshot_world.py), checkpoints every
5 steps of 12: the write of the checkpoint of step 10 is held until step 12 is done, so steps 11
and 12 train while it is in flight (its directory does not exist yet), and the last step's save
waits for it. Then every checkpoint (5, 10, 12) is complete and valid, a gang resumed from the
background-written checkpoint of step 10 continues the held run's losses within 1e-6, and each
rank's snapshot gauges say what it holds."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dtjob.trainer.checkpoint import MANIFEST, verify
from tests.trainer._snapshot_world import STEPS, run_gang

pytestmark = pytest.mark.slow

HELD = 10


def test_a_checkpoint_written_in_the_background_lets_the_next_steps_train_and_is_exact(
    tmp_path: Path,
) -> None:
    case = {
        "strategy": "fsdp",
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "pods": [str(tmp_path / "pod0"), str(tmp_path / "pod1")],
        "hold_checkpoint": HELD,
    }
    ranks = run_gang(2, 1, case, tmp_path / "out")
    assert [r["published"] for r in ranks] == [False, False], "steps 11 and 12 ran while it was written"
    assert sorted(ranks[0]["losses"]) == list(range(1, STEPS + 1))
    steps = sorted(int(d.name.removeprefix("step-")) for d in (tmp_path / "ckpt").glob("step-*"))
    assert steps == [5, HELD, STEPS]
    for step in steps:
        manifest = verify(tmp_path / "ckpt" / f"step-{step:08d}")  # raises unless complete and sound
        assert manifest["step"] == step and manifest["world_size"] == 2
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".staging")]
    for rank, r in enumerate(ranks):
        g = r["gauges"]
        assert g["last_checkpoint_step"] == STEPS
        assert g["snapshot_step"] == STEPS - 1 or g["snapshot_step"] == STEPS, g
        assert g["own_bytes"] > 0 and g["buddy_bytes"] > 0 and g["snapshot_seconds"] > 0, (rank, g)
    # A gang resumed from the background-written checkpoint of step 10 (snapshots off, so the
    # checkpoint's own loader) continues the same losses.
    again = tmp_path / "again"
    (again / "ckpt").mkdir(parents=True)
    shutil.copytree(tmp_path / "ckpt" / f"step-{HELD:08d}", again / "ckpt" / f"step-{HELD:08d}")
    assert (again / "ckpt" / f"step-{HELD:08d}" / MANIFEST).is_file()
    resumed_case = {
        "strategy": "fsdp",
        "checkpoint_dir": str(again / "ckpt"),
        "snapshot_every": 0,
        "pods": [str(again / "none0"), str(again / "none1")],
        "uid": "resumed",
    }
    resumed = run_gang(2, 1, resumed_case, again / "out")
    assert [r["start"] for r in resumed] == [HELD] * 2
    for step, loss in resumed[0]["losses"].items():
        want = ranks[0]["losses"][step]
        assert abs(loss - want) <= 1e-6 * abs(want), (step, loss, want)
