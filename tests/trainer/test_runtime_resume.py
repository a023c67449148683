"""Exact resume across world sizes: a checkpoint written by 4 processes continues the same
trajectory with 2 and with 3 (real `python -m dtjob.trainer` gangs over gloo on localhost).

DDP and ZeRO-3 run side by side (two reference gangs at once, then four resumed gangs at once):
most of each process's time is importing torch, and overlapping those keeps the test short.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.runtime_gang import TINY_GPT, Gang, checkpoint_steps, launch

pytestmark = pytest.mark.slow

# 12 is divisible by 4, 3 and 2, so every world size splits the same global batch evenly.
# fmt: off
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
]
# fmt: on
STRATEGIES = {"ddp": ["--strategy", "ddp"], "zero3": ["--strategy", "fsdp", "--zero-stage", "3"]}
REL_TOL = 1e-5


def losses(steps: list[dict[str, Any]]) -> dict[int, float]:
    return {int(s["step"]): float(s["loss"]) for s in steps}


def wait_ok(gangs: dict[str, Gang]) -> None:
    for name, gang in gangs.items():
        codes = gang.wait()
        assert codes == [0] * len(codes), f"{name}: exit codes {codes}\n{gang.stderr()}"


def test_resume_at_other_world_sizes_continues_the_same_trajectory(tmp_path: Path) -> None:
    full = {
        name: launch(
            4, [*ARGS, *flags, "--checkpoint-dir", str(tmp_path / f"{name}-full")], tmp_path, f"{name}-full"
        )
        for name, flags in STRATEGIES.items()
    }
    wait_ok(full)
    reference = {name: losses(gang.steps()) for name, gang in full.items()}
    for name in STRATEGIES:
        assert sorted(reference[name]) == list(range(1, 21)), name
        assert checkpoint_steps(tmp_path / f"{name}-full") == [10, 20], name
        assert reference[name][20] < reference[name][1], f"{name}: the reference run did not learn at all"

    resumed: dict[str, Gang] = {}
    for name, flags in STRATEGIES.items():
        for world_size in (2, 3):
            run_name = f"{name}-resumed{world_size}"
            directory = tmp_path / run_name
            # The 4-process run as it was when it stopped after its step-10 checkpoint.
            shutil.copytree(tmp_path / f"{name}-full" / "step-00000010", directory / "step-00000010")
            args = [*ARGS, *flags, "--checkpoint-dir", str(directory)]
            resumed[run_name] = launch(world_size, args, tmp_path, run_name)
    wait_ok(resumed)

    for run_name, gang in resumed.items():
        name, world_size = run_name.split("-resumed")[0], int(run_name[-1])
        got = losses(gang.steps())
        assert sorted(got) == list(range(11, 21)), f"{run_name} ran steps {sorted(got)}"
        assert all(s["world_size"] == world_size for s in gang.steps())
        assert "written at world size 4" in gang.stderr(0), (
            f"{run_name} did not resume the 4-process checkpoint"
        )
        for step in range(11, 21):
            want = reference[name][step]
            assert abs(got[step] - want) / abs(want) < REL_TOL, (
                f"{run_name}, step {step}: {got[step]} vs {want}"
            )
