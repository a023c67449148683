"""The built-in trainer's --tensor-parallel (#44): real `python -m dtjob.trainer` gangs over gloo.

TP 2 x DP 2 (world 4) under --strategy ddp and under fsdp ZeRO-2 logs, step by step, the losses
of one process training the unsplit GPT on the same global batch; the ZeRO-2 run's checkpoint
resumes at TP 2 x DP 1 (world 2) and continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from dtjob.trainer import build
from dtjob.trainer.config import ConfigError, parse
from tests.trainer.runtime_gang import TINY_GPT, Gang, checkpoint_steps, launch

# fmt: off
ARGS = [
    *TINY_GPT,  # 2 heads: one per TP rank
    "--global-batch-size", "8",
    "--steps", "8",
    "--lr", "3e-3",
    "--warmup-steps", "2",
    "--checkpoint-every", "4",
    "--seed", "11",
    "--collective", "native",
]
# fmt: on
STRATEGIES = {"ddp": ["--strategy", "ddp"], "zero2": ["--strategy", "fsdp", "--zero-stage", "2"]}
REL_TOL = 1e-5


def _losses(gang: Gang) -> dict[int, float]:
    return {int(s["step"]): float(s["loss"]) for s in gang.steps()}


def _wait_ok(gangs: dict[str, Gang]) -> None:
    for name, gang in gangs.items():
        codes = gang.wait()
        assert codes == [0] * len(codes), f"{name}: exit codes {codes}\n{gang.stderr()}"


def _assert_same(name: str, got: dict[int, float], want: dict[int, float], steps: range) -> None:
    assert sorted(got) == list(steps), f"{name} ran steps {sorted(got)}"
    for step in steps:
        assert abs(got[step] - want[step]) / abs(want[step]) < REL_TOL, (
            f"{name}, step {step}: {got[step]} vs one process's {want[step]}"
        )


@pytest.mark.slow
def test_tp2_equals_one_process_and_resumes_at_another_dp_size(tmp_path: Path) -> None:
    gangs = {"one-process": launch(1, ARGS, tmp_path, "one-process")}
    for name, flags in STRATEGIES.items():
        args = [*ARGS, *flags, "--tensor-parallel", "2", "--checkpoint-dir", str(tmp_path / name)]
        gangs[name] = launch(4, args, tmp_path, name)
    _wait_ok(gangs)
    reference = _losses(gangs["one-process"])
    assert reference[8] < reference[1], "the reference run did not learn at all"
    for name in STRATEGIES:
        _assert_same(name, _losses(gangs[name]), reference, range(1, 9))
        assert all((s["tensor_parallel"], s["data_parallel"]) == (2, 2) for s in gangs[name].steps())
        assert "tensor parallel 2 x pipeline 1 x data parallel 2 (world 4" in gangs[name].stderr(0)
        assert checkpoint_steps(tmp_path / name) == [4, 8], name

    resumed: dict[str, Gang] = {}
    for name, flags in STRATEGIES.items():
        directory = tmp_path / f"{name}-dp1"
        # The TP2 x DP2 run as it was after its step-4 checkpoint, continued by one TP pair.
        shutil.copytree(tmp_path / name / "step-00000004", directory / "step-00000004")
        args = [*ARGS, *flags, "--tensor-parallel", "2", "--checkpoint-dir", str(directory)]
        resumed[name] = launch(2, args, tmp_path, f"{name}-dp1")
    _wait_ok(resumed)
    for name, gang in resumed.items():
        _assert_same(f"{name} resumed at DP 1", _losses(gang), reference, range(5, 9))
        steps: list[dict[str, Any]] = gang.steps()
        assert all((s["tensor_parallel"], s["data_parallel"], s["world_size"]) == (2, 1, 2) for s in steps)
        assert "written at world size 4" in gang.stderr(0), f"{name} did not resume the TP2 x DP2 checkpoint"


@pytest.mark.slow
def test_a_checkpoint_of_another_tensor_parallel_size_is_refused_naming_full_state_dict(
    tmp_path: Path,
) -> None:
    args = [*ARGS, "--steps", "4", "--checkpoint-dir", str(tmp_path / "tp2")]
    first = launch(2, [*args, "--tensor-parallel", "2"], tmp_path, "tp2")
    _wait_ok({"tp2": first})
    second = launch(2, args, tmp_path, "tp1")  # the same directory, no tensor parallelism
    assert second.wait() == [2, 2], second.stderr()
    assert "written with --tensor-parallel 2, this run has 1" in second.stderr(0)
    assert "full_state_dict" in second.stderr(0)


def test_a_user_model_without_an_auto_plan_is_refused_naming_the_alternative() -> None:
    c = parse(["--model", "tests.trainer.x:factory", "--tensor-parallel", "2"], {"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError) as err:
        build.parallelize(nn.Sequential(nn.Linear(4, 4)), c)
    message = str(err.value)
    assert "--tensor-parallel 2: tensor_parallel's plan='auto' does not know" in message
    assert "ElasticSession and tensor_parallel(model, plan={...}) with an explicit plan" in message
