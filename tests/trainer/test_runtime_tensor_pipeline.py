"""The built-in trainer's --tensor-parallel with --strategy pipeline (#44): a real `python -m
dtjob.trainer` gang of TP 2 x PP 2 (world 4, gloo) logs, step by step, the losses of one process
training the unsplit GPT on the same global batch (the loss computed on the last stage with
vocab_parallel_cross_entropy), and its step-4 checkpoint resumes at the same size exactly.

Not here: a resume at another data-parallel size (TP 2 x PP 2 x DP 2 needs world 8, too slow on
this 2-core machine); tests/trainer/test_parallel_3d.py checks the pipeline's TP checkpoints
across DP sizes and wrappers with the library's TrainState.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer.runtime_gang import Gang, checkpoint_steps, launch
from tests.trainer.test_runtime_tensor_parallel import ARGS, _assert_same, _losses, _wait_ok

PIPELINE = ["--strategy", "pipeline", "--pipeline-stages", "2", "--microbatches", "2"]
TP2_PP2 = [*PIPELINE, "--tensor-parallel", "2"]


@pytest.mark.slow
def test_tp2_pp2_equals_one_process_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    gangs: dict[str, Gang] = {
        "one-process": launch(1, ARGS, tmp_path, "one-process"),
        "tp2-pp2": launch(
            4, [*ARGS, *TP2_PP2, "--checkpoint-dir", str(tmp_path / "tp2-pp2")], tmp_path, "tp2-pp2"
        ),
    }
    _wait_ok(gangs)
    reference = _losses(gangs["one-process"])
    assert reference[8] < reference[1], "the reference run did not learn at all"
    tp_pp = gangs["tp2-pp2"]
    _assert_same("tp2-pp2", _losses(tp_pp), reference, range(1, 9))
    assert all((s["tensor_parallel"], s["data_parallel"]) == (2, 1) for s in tp_pp.steps())
    assert "tensor parallel 2 x pipeline 2 x data parallel 1 (world 4" in tp_pp.stderr(0)
    assert checkpoint_steps(tmp_path / "tp2-pp2") == [4, 8]

    # The run as it was after its step-4 checkpoint, continued by a new gang of the same shape.
    directory = tmp_path / "resumed"
    shutil.copytree(tmp_path / "tp2-pp2" / "step-00000004", directory / "step-00000004")
    resumed = launch(4, [*ARGS, *TP2_PP2, "--checkpoint-dir", str(directory)], tmp_path, "resumed")
    _wait_ok({"resumed": resumed})
    _assert_same("tp2-pp2 resumed", _losses(resumed), reference, range(5, 9))
    assert "written at world size 4" in resumed.stderr(0), "it did not resume the step-4 checkpoint"
