"""Exact resume across world sizes: a checkpoint written by 4 processes continues the same
trajectory with 2 and with 3 (real `python -m dtjob.trainer` gangs over gloo on localhost)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.runtime_gang import TINY_GPT, checkpoint_steps, run

pytestmark = pytest.mark.slow

# 12 is divisible by 4, 3 and 2, so every world size splits the same global batch evenly.
ARGS = [
    *TINY_GPT,
    "--global-batch-size", "12",
    "--steps", "20",
    "--lr", "3e-3",
    "--warmup-steps", "3",
    "--checkpoint-every", "10",
    "--keep-checkpoints", "5",
    "--seed", "7",
    "--collective", "native",
]  # fmt: skip
REL_TOL = 1e-5


def losses(steps: list[dict[str, Any]]) -> dict[int, float]:
    return {int(s["step"]): float(s["loss"]) for s in steps}


@pytest.mark.parametrize(
    "strategy", [["--strategy", "ddp"], ["--strategy", "fsdp", "--zero-stage", "3"]], ids=["ddp", "zero3"]
)
def test_resume_at_other_world_sizes_continues_the_same_trajectory(
    tmp_path: Path, strategy: list[str]
) -> None:
    full_dir = tmp_path / "full"
    full = run(4, [*ARGS, *strategy, "--checkpoint-dir", str(full_dir)], tmp_path, "full")
    reference = losses(full.steps())
    assert sorted(reference) == list(range(1, 21))
    assert checkpoint_steps(full_dir) == [10, 20]
    assert reference[20] < reference[1], "the reference run did not learn at all"

    for world_size in (2, 3):
        resumed_dir = tmp_path / f"resumed{world_size}"
        resumed_dir.mkdir()
        # The 4-process run as it was when it stopped after its step-10 checkpoint.
        shutil.copytree(full_dir / "step-00000010", resumed_dir / "step-00000010")
        resumed = run(
            world_size, [*ARGS, *strategy, "--checkpoint-dir", str(resumed_dir)], tmp_path, f"r{world_size}"
        )
        got = losses(resumed.steps())
        assert sorted(got) == list(range(11, 21)), f"world size {world_size} ran steps {sorted(got)}"
        assert all(s["world_size"] == world_size for s in resumed.steps())
        for step in range(11, 21):
            rel = abs(got[step] - reference[step]) / abs(reference[step])
            assert rel < REL_TOL, f"world size {world_size}, step {step}: {got[step]} vs {reference[step]}"
