"""Recovery from in-memory snapshots (trainer/snapshot.py, snapshot_recovery.py) in real gangs of
ElasticSession processes: 4 ranks as 2 pods of 2, each pod with its own snapshot directory, durable
checkpoints every 5 steps. Every process dies after step 7 (os._exit: the pod's agent then starts
new trainers in place, the pods' memory directories remain); a new gang over the same directories
resumes at step 7, not at the checkpoint of step 5, and continues the uninterrupted run's loss
trajectory within 1e-6 (DDP and ZeRO-3). Also: one pod's memory lost (recovered from the buddy
copies), both copies of a shard lost (falls back to the checkpoint and says so), and a gang of
2 recovering the 4-rank snapshot (the trajectory of a resume from a checkpoint of step 7)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer._snapshot_world import STEPS, run_gang

pytestmark = pytest.mark.slow

DIE_AFTER = 7
TOLERANCE = 1e-6


def _case(root: Path, strategy: str, **more: Any) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "checkpoint_dir": str(root / "ckpt"),
        "pods": [str(root / "pod0"), str(root / "pod1")],
        **more,
    }


def _copy(src: Path, dst: Path) -> Path:
    """The killed gang's checkpoint and memory directories, for one scenario to change."""
    for name in ("ckpt", "pod0", "pod1"):
        shutil.copytree(src / name, dst / name, symlinks=True)
    return dst


def _killed(root: Path, strategy: str, **more: Any) -> list[dict[str, Any]]:
    ranks = run_gang(4, 2, _case(root, strategy, die_after=DIE_AFTER, **more), root / "out")
    assert sorted(ranks[0]["losses"]) == list(range(1, DIE_AFTER + 1))
    # Every step, 5 (checkpointed) too; the wait in the loop leaves none in flight at the next.
    assert [r["snapshots"] for r in ranks] == [{"taken": DIE_AFTER, "skipped": 0}] * 4
    return ranks


def _same_trajectory(got: dict[int, float], want: dict[int, float], start: int) -> None:
    assert sorted(got) == list(range(start + 1, STEPS + 1))
    for step, loss in got.items():
        assert abs(loss - want[step]) <= TOLERANCE * abs(want[step]), (step, loss, want[step])


@pytest.fixture(scope="module")
def ddp_killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DDP gang killed after step 7, which also wrote a checkpoint of step 7 to `x7`."""
    root = tmp_path_factory.mktemp("ddp-killed")
    _killed(root, "ddp", also_save=str(root / "x7"))
    return root


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("ddp-reference")
    losses: dict[int, float] = run_gang(4, 2, _case(root, "ddp", uid="reference"), root / "out")[0]["losses"]
    return losses


def test_a_gang_restarted_in_place_resumes_at_the_killed_step_from_memory(
    ddp_killed: Path, ddp_reference: dict[int, float], tmp_path: Path
) -> None:
    root = _copy(ddp_killed, tmp_path)
    ranks = run_gang(4, 2, _case(root, "ddp"), root / "out")
    assert [r["start"] for r in ranks] == [DIE_AFTER] * 4
    assert any("resumed from host memory" in line for line in ranks[0]["lines"]), ranks[0]["lines"]
    _same_trajectory(ranks[0]["losses"], ddp_reference, DIE_AFTER)
    # The run completed: its snapshots are gone from both pods' memory.
    assert not list((root / "pod0").iterdir()) and not list((root / "pod1").iterdir())


def test_a_lost_pods_shards_come_from_the_buddy_copies(
    ddp_killed: Path, ddp_reference: dict[int, float], tmp_path: Path
) -> None:
    root = _copy(ddp_killed, tmp_path)
    shutil.rmtree(root / "pod1")  # pod 1 replaced: a fresh pod, empty memory
    (root / "pod1").mkdir()
    ranks = run_gang(4, 2, _case(root, "ddp"), root / "out")
    assert [r["start"] for r in ranks] == [DIE_AFTER] * 4
    _same_trajectory(ranks[0]["losses"], ddp_reference, DIE_AFTER)


def test_both_copies_of_a_shard_lost_falls_back_to_the_checkpoint_and_says_so(
    ddp_killed: Path, ddp_reference: dict[int, float], tmp_path: Path
) -> None:
    root = _copy(ddp_killed, tmp_path)
    gone = [p for pod in ("pod0", "pod1") for p in (root / pod).glob("run-*/step-*/rank-00001.*")]
    assert len(gone) >= 4  # rank 1's own file (pod 0) and its buddy copy (pod 1), each with its info
    for path in gone:
        path.unlink()
    ranks = run_gang(4, 2, _case(root, "ddp"), root / "out")
    assert [r["start"] for r in ranks] == [5] * 4
    said = [line for line in ranks[0]["lines"] if line.startswith("fell back")]
    assert said and said[0].startswith(
        f"fell back to the checkpoint of step 5: the snapshot of step {DIE_AFTER} lost shards 1"
    ), ranks[0]["lines"]
    _same_trajectory(ranks[0]["losses"], ddp_reference, 5)


def test_a_smaller_gang_from_memory_continues_as_from_a_checkpoint_of_that_step(
    ddp_killed: Path, tmp_path: Path
) -> None:
    root = _copy(ddp_killed, tmp_path)
    from_memory = run_gang(2, 1, _case(root, "ddp"), root / "out")
    assert [r["start"] for r in from_memory] == [DIE_AFTER] * 2
    yardstick_case = {
        "strategy": "ddp",
        "checkpoint_dir": str(ddp_killed / "x7"),
        "snapshot_every": 0,
        "pods": [str(tmp_path / "none0"), str(tmp_path / "none1")],
        "uid": "x7",
    }
    from_checkpoint = run_gang(2, 1, yardstick_case, tmp_path / "yardstick")
    assert [r["start"] for r in from_checkpoint] == [DIE_AFTER] * 2
    _same_trajectory(from_memory[0]["losses"], from_checkpoint[0]["losses"], DIE_AFTER)


def test_zero3_restarted_in_place_resumes_at_the_killed_step_from_memory(tmp_path: Path) -> None:
    reference = run_gang(4, 2, _case(tmp_path / "ref", "fsdp", uid="reference"), tmp_path / "ref" / "out")
    _killed(tmp_path / "run", "fsdp")
    ranks = run_gang(4, 2, _case(tmp_path / "run", "fsdp"), tmp_path / "run" / "again")
    assert [r["start"] for r in ranks] == [DIE_AFTER] * 4
    _same_trajectory(ranks[0]["losses"], reference[0]["losses"], DIE_AFTER)


def test_a_damaged_snapshot_file_falls_back_to_the_checkpoint_and_says_so(
    ddp_killed: Path, ddp_reference: dict[int, float], tmp_path: Path
) -> None:
    root = _copy(ddp_killed, tmp_path)
    for damaged in (root / "pod1").glob(f"run-*/step-{DIE_AFTER:08d}/rank-00002.pt"):
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0x01  # its info (sha256, size) still says the file is complete
        damaged.write_bytes(bytes(data))
    ranks = run_gang(4, 2, _case(root, "ddp"), root / "out")
    assert [r["start"] for r in ranks] == [5] * 4
    said = [line for line in ranks[0]["lines"] if line.startswith("fell back")]
    damaged_line = f"the snapshot of step {DIE_AFTER} has damaged files rank-00002.pt"
    assert said == [f"fell back to the checkpoint of step 5: {damaged_line}"], ranks[0]["lines"]
    _same_trajectory(ranks[0]["losses"], ddp_reference, 5)
