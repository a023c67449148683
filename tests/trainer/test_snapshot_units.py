"""In-memory snapshots in one process: which step recovery picks and what it says it lost (a pure
function), the host memory refusal, and a snapshot being a loadable checkpoint rank file."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtjob.trainer.checkpoint import RankFileInfo, ShardReader, build_manifest
from dtjob.trainer.snapshot import SnapshotMemoryError, Snapshots, host_bytes, inventory
from dtjob.trainer.snapshot_recovery import choose
from dtjob.trainer.train_state import TrainState


def _held(step: int, owner: int, world: int) -> dict[str, Any]:
    return {"step": step, "owner": owner, "name": f"rank-{owner:05d}.pt", "meta": {"world_size": world}}


def test_recovery_picks_the_newest_step_whose_every_shard_is_held_somewhere() -> None:
    # Rank 0 holds its own and rank 1's buddy copy of step 8; rank 1 only its step 7 (step 8 lost).
    held = [
        [_held(8, 0, 2), _held(8, 1, 2), _held(7, 0, 2)],
        [_held(7, 1, 2)],
    ]
    step, infos, holders, lost = choose(held, durable=5)
    assert step == 8 and sorted(infos) == [0, 1] and holders[(8, 1)] == [0]
    assert lost == []
    held[0] = [_held(8, 0, 2), _held(7, 0, 2)]  # the buddy copy of step 8 gone too
    step, _, holders, lost = choose(held, durable=5)
    assert step == 7 and holders[(7, 1)] == [1]
    assert lost == ["the snapshot of step 8 lost shards 1"]


def test_recovery_takes_no_snapshot_older_than_the_checkpoint_nor_of_mixed_worlds() -> None:
    held = [[_held(7, 0, 2), _held(7, 1, 2)], []]
    assert choose(held, durable=8)[0] is None  # older than the checkpoint: load that
    assert choose(held, durable=7)[0] == 7, "at the checkpoint's step, memory (no disk read)"
    mixed = [[_held(9, 0, 2), _held(9, 1, 4)], [_held(9, 2, 4), _held(9, 3, 4)]]
    step, _, _, lost = choose(mixed, durable=5)
    assert step is None and lost == ["the snapshot of step 9 lost shards (mixed worlds)"]


@pytest.fixture
def one_process() -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def _state() -> TrainState:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    return TrainState(model, optimizer, extras={"tokens": 123})


def test_a_snapshot_beyond_the_memory_limit_is_refused_naming_the_setting(
    one_process: None, tmp_path: Path
) -> None:
    state = _state()
    own = sum(s.local.numel() * s.local.element_size() for s in state.state_shards().values())
    assert host_bytes(own, 0) == 4 * own  # one pod: no buddy copy
    snaps = Snapshots(tmp_path, "job", 0, 1, 1, every=1, memory_limit=host_bytes(own, 0) - 1)
    with pytest.raises(SnapshotMemoryError, match=r"DTJOB_SNAPSHOT_MEMORY_LIMIT.*DTJOB_SNAPSHOT_EVERY=0"):
        snaps.take(1, state, {})
    fits = Snapshots(tmp_path, "job", 0, 1, 1, every=1, memory_limit=host_bytes(own, 0))
    assert fits.take(1, state, {})
    fits.wait()


def test_a_snapshot_is_a_checkpoint_rank_file_of_its_step(
    one_process: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state()
    with caplog.at_level(logging.WARNING, "dtjob.trainer.snapshot"):
        snaps = Snapshots(tmp_path, "job", 0, 1, 1, every=1)
    assert "no buddy copies" in caplog.text
    want = {k: s.local.clone() for k, s in state.state_shards().items()}
    snaps.take(4, state, {"data": {"next_step": 5}})
    for p in state.model.parameters():  # the step after it changes the state in place
        p.data.add_(1.0)
    snaps.wait()
    [info] = inventory(snaps.root)
    assert (info["step"], info["owner"], info["meta"]["step"]) == (4, 0, 4)
    rank_file = RankFileInfo(
        info["name"], info["sha256"], info["bytes"], {k: tuple(v) for k, v in info["index"].items()}
    )  # type: ignore[misc]
    reader = ShardReader(snaps.root / "step-00000004", build_manifest([rank_file], info["meta"]))
    for key, tensor in want.items():
        assert torch.equal(reader.fetch(key, 0, tensor.numel()), tensor), key
    assert reader.global_state()["extras"] == {"tokens": 123}
    snaps.take(5, state, {})
    snaps.wait()
    snaps.take(6, state, {})  # step 5 complete everywhere: step 4 deleted
    snaps.wait()
    assert sorted(i["step"] for i in inventory(snaps.root)) == [5, 6]
