"""The checkpoint directory's claim (trainer/fence.py) on real files: who holds it, who is stale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtjob.trainer.elastic import StaleGenerationError
from dtjob.trainer.fence import OWNER, Fence


def test_the_newest_gang_holds_the_claim_and_an_older_one_cannot_take_it(tmp_path: Path) -> None:
    first = Fence(tmp_path, "uid-a", 3)
    first.take()
    assert first.superseded() is None
    second = Fence(tmp_path, "uid-a", 4)
    second.take()
    assert first.superseded() == second.claim, "generation 4's claim replaced generation 3's"
    assert second.superseded() is None
    with pytest.raises(StaleGenerationError, match="generation 3 is stale: generation 4 of this job"):
        Fence(tmp_path, "uid-a", 3).take()
    assert json.loads((tmp_path / OWNER).read_text()) == second.claim, "a stale gang leaves the claim"
    assert sorted(p.name for p in tmp_path.iterdir()) == [OWNER], "no temporary file left"


def test_a_job_created_again_over_the_same_volume_takes_the_claim_over(tmp_path: Path) -> None:
    old = Fence(tmp_path, "uid-old", 7)
    old.take()
    new = Fence(tmp_path, "uid-new", 0)
    new.take()  # generation 0 of another job: no StaleGenerationError
    assert old.superseded() == new.claim


def test_a_claim_gone_or_unreadable_stops_no_gang(tmp_path: Path) -> None:
    fence = Fence(tmp_path, "uid-a", 1)
    fence.take()
    (tmp_path / OWNER).unlink()
    assert fence.superseded() is None
    (tmp_path / OWNER).write_text("{not json")
    assert fence.superseded() is None
    Fence(tmp_path, "uid-a", 2).take()  # an unreadable claim is claimed anew
    assert fence.superseded() is not None
