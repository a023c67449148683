"""Buffers as torch does them (issue #40): every wrapper keeps BatchNorm's running statistics equal
on the ranks of a replica group (rank 0's, broadcast before a forward, as torch's DDP with
broadcast_buffers=True), and a checkpoint holds rank 0's, so a resume at another world size
evaluates as the uninterrupted run. Real gloo groups; the model and the one-process reference are
in _buffers_worker.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer._buffers_worker import BuffersWorld, check, reference

STEPS = 3
TRAINED = ("ddp", "zero1", "zero2", "zero3")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _trained_cases(tmp: Path) -> list[dict[str, Any]]:
    cases = [{"name": s, "strategy": s, "steps": STEPS, "save_to": str(tmp / s)} for s in TRAINED]
    cases.append({"name": "ddp-off", "strategy": "ddp", "steps": STEPS, "broadcast_buffers": False})
    return cases


def _resumed_cases(tmp: Path, names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{"name": s, "strategy": s, "load_from": str(tmp / s)} for s in names]


@pytest.mark.slow
def test_bn_buffers_agree_match_one_process_and_resume(tmp_path: Path) -> None:
    # World 2: data_parallel and ZeRO-1/2/3; world 4: a 2-stage pipeline with 2 replicas (its
    # replica r trains on the rows data_parallel's rank r does). Both at once: spawning is slow.
    two = BuffersWorld(2, _trained_cases(tmp_path))
    pipe = BuffersWorld(
        4,
        [{"name": "pipeline", "strategy": "pipeline", "steps": STEPS, "save_to": str(tmp_path / "pipeline")}],
    )
    trained, piped = check(two.results()), check(pipe.results())
    ref = reference(STEPS, world=2)

    for name in TRAINED:
        evals = [r[name]["eval"] for r in trained]
        assert _max_diff(evals[0], evals[1]) <= 1e-6, f"{name}: eval outputs differ between ranks"
        assert _max_diff(evals[0], ref["eval"]) <= 1e-5, f"{name}: eval outputs differ from one process"
        losses = torch.tensor([r[name]["losses"] for r in trained]).mean(0)
        assert _max_diff(losses, torch.tensor(ref["losses"])) <= 1e-5, f"{name}: losses"
        # full_state_dict(rank0_only=False): every rank gets rank 0's buffers.
        for key, value in ref["buffers"].items():
            for r in trained:
                assert _max_diff(r[name]["full"][key].double(), value.double()) <= 1e-5, f"{name}: {key}"
    # The switch works: without the broadcast, the ranks' statistics (and eval outputs) part.
    off = [r["ddp-off"]["eval"] for r in trained]
    assert _max_diff(off[0], off[1]) > 1e-3

    last_stage = [r["pipeline"]["eval"] for r in piped if r["pipeline"]["eval"] is not None]
    assert len(last_stage) == 2
    assert _max_diff(last_stage[0], last_stage[1]) <= 1e-6, "pipeline: replicas' eval outputs differ"
    # Each replica's rows in 2 micro-batches: BatchNorm normalises (and updates) per micro-batch.
    ref_pipe = reference(STEPS, world=2, microbatches=2)
    assert _max_diff(last_stage[0], ref_pipe["eval"]) <= 1e-5, (
        "pipeline: eval outputs differ from one process"
    )
    pipe_losses = torch.tensor(piped[0]["pipeline"]["losses"])
    assert _max_diff(pipe_losses, torch.tensor(ref_pipe["losses"])) <= 1e-5

    # Resume: data_parallel and ZeRO at world 3 and 1, the pipeline at world 2 (one replica).
    three = BuffersWorld(3, _resumed_cases(tmp_path, TRAINED))
    one = BuffersWorld(1, _resumed_cases(tmp_path, ("ddp", "zero3")))
    pipe2 = BuffersWorld(2, _resumed_cases(tmp_path, ("pipeline",)))
    resumed = check(three.results()) + check(one.results())
    for name in TRAINED:
        for r in resumed:
            if name in r:
                got = r[name]["eval"]
                assert _max_diff(got, trained[0][name]["eval"]) <= 1e-6, f"{name}: resumed eval outputs"
    piped2 = check(pipe2.results())
    resumed_pipe = [r["pipeline"]["eval"] for r in piped2 if r["pipeline"]["eval"] is not None]
    assert len(resumed_pipe) == 1
    assert _max_diff(resumed_pipe[0], last_stage[0]) <= 1e-6, "pipeline: resumed eval outputs"
