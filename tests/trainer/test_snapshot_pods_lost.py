"""Pods lost with their memory, in real gangs of ElasticSession processes (_snapshot_world.py):
every process of the gang dies after step 7 (durable checkpoints every 5 steps, written in the
background from the snapshot), then some pods come back with empty memory.

- Two pods of three lost at once (3 pods of 1 rank; rank r's buddy copy is on pod r + 1): rank 0's
  file and its buddy copy are both gone, so the gang falls back to the durable checkpoint of step 5,
  continues exactly as a run resumed from that checkpoint, says `resumed_from: checkpoint`, and
  serves the step it wanted (7) for the operator's event RecoveredFromCheckpoint.
- ZeRO-3 (fully_shard) at 4 ranks (2 pods of 2), pod 1 lost: a gang of 2 and a gang of 3 resume at
  step 7 from pod 0's memory (its own files and pod 1's buddy copies), resharded, and continue
  exactly as a run resumed from a durable checkpoint of step 7 at that world size.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer._snapshot_world import STEPS, run_gang

pytestmark = pytest.mark.slow

DIE_AFTER = 7
TOLERANCE = 1e-6


def _case(root: Path, strategy: str, pods: int, **more: Any) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "checkpoint_dir": str(root / "ckpt"),
        "pods": [str(root / f"pod{i}") for i in range(pods)],
        **more,
    }


def _same_trajectory(got: dict[int, float], want: dict[int, float], start: int) -> None:
    assert sorted(got) == list(range(start + 1, STEPS + 1))
    assert sorted(want) == list(range(start + 1, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - want[step]) <= TOLERANCE * abs(want[step]), (step, loss, want[step])


def _first_record(root: Path) -> dict[str, Any]:
    return dict(json.loads((root / "steps.jsonl").read_text().splitlines()[0]))


def _yardstick(checkpoint: Path, world: int, strategy: str, tmp: Path) -> dict[int, float]:
    """The losses of a gang of `world` resumed from (a copy of: it writes its own checkpoints) the
    durable checkpoint in `checkpoint`, without snapshots: the checkpoint's own loader."""
    shutil.copytree(checkpoint, tmp / "ckpt")
    case = {
        "strategy": strategy,
        "checkpoint_dir": str(tmp / "ckpt"),
        "snapshot_every": 0,
        "pods": [str(tmp / f"none{i}") for i in range(world)],
        "uid": f"yardstick-{world}",
    }
    ranks = run_gang(world, 1, case, tmp / "out")
    return dict(ranks[0]["losses"])


def test_a_shard_and_its_buddy_lost_falls_back_to_the_checkpoint_and_says_which_step_it_wanted(
    tmp_path: Path,
) -> None:
    killed = run_gang(3, 1, _case(tmp_path, "ddp", 3, die_after=DIE_AFTER), tmp_path / "killed")
    assert [r["gauges"]["snapshot_step"] for r in killed] == [DIE_AFTER] * 3
    assert [r["gauges"]["last_checkpoint_step"] for r in killed] == [5] * 3, "written in the background"
    # The pods of ranks 0 and 1 are replaced: rank 0's own file (pod 0) and its copy (pod 1) gone.
    for pod in ("pod0", "pod1"):
        shutil.rmtree(tmp_path / pod)
        (tmp_path / pod).mkdir()
    durable = tmp_path / "durable"
    shutil.copytree(tmp_path / "ckpt", durable)  # before the gang below writes checkpoints 10 and 12
    ranks = run_gang(3, 1, _case(tmp_path, "ddp", 3), tmp_path / "again")
    assert [r["start"] for r in ranks] == [5] * 3
    said = [line for line in ranks[0]["lines"] if line.startswith("fell back")]
    # Steps 7 and 6 (kept until 7 is complete everywhere) both lost rank 0's shards.
    assert said == [
        f"fell back to the checkpoint of step 5: the snapshot of step {DIE_AFTER} lost shards 0; "
        f"the snapshot of step {DIE_AFTER - 1} lost shards 0"
    ], ranks[0]["lines"]
    assert _first_record(tmp_path / "again")["resumed_from"] == "checkpoint"
    assert [(r["gauges"]["resumed_step"], r["gauges"]["resume_lost_step"]) for r in ranks] == [
        (5, DIE_AFTER)
    ] * 3
    _same_trajectory(ranks[0]["losses"], _yardstick(durable, 3, "ddp", tmp_path / "yardstick"), 5)


@pytest.fixture(scope="module")
def zero3_pod_lost(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ZeRO-3 gang of 4 (2 pods of 2) killed after step 7, with a durable checkpoint of step 7 in
    `x7` (the yardstick); then pod 1 is replaced (its memory empty)."""
    root = tmp_path_factory.mktemp("zero3")
    ranks = run_gang(
        4, 2, _case(root, "fsdp", 2, die_after=DIE_AFTER, also_save=str(root / "x7")), root / "out"
    )
    assert [r["gauges"]["snapshot_step"] for r in ranks] == [DIE_AFTER] * 4
    shutil.rmtree(root / "pod1")
    return root


@pytest.mark.parametrize("world", [2, 3])
def test_zero3_continues_at_a_smaller_world_from_the_survivors_memory(
    zero3_pod_lost: Path, world: int, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    shutil.copytree(zero3_pod_lost / "pod0", root / "pod0", symlinks=True)
    shutil.copytree(zero3_pod_lost / "ckpt", root / "ckpt")
    # One rank per pod: rank 0 on the surviving pod, the others on new pods (empty memory), so
    # they fetch every file they need from rank 0.
    case = _case(root, "fsdp", world)
    ranks = run_gang(world, 1, case, root / "out")
    assert [r["start"] for r in ranks] == [DIE_AFTER] * world
    assert _first_record(root / "out")["resumed_from"] == "memory"
    assert [r["gauges"]["resume_lost_step"] for r in ranks] == [0] * world
    yardstick = _yardstick(zero3_pod_lost / "x7", world, "fsdp", tmp_path / "yardstick")
    _same_trajectory(ranks[0]["losses"], yardstick, DIE_AFTER)
