"""Buffers as torch does them (issue #40): every wrapper keeps BatchNorm's running statistics equal
on the ranks of a replica group (rank 0's, broadcast before a forward, as torch's DDP with
broadcast_buffers=True), a checkpoint holds rank 0's, so a resume at another world size evaluates
as the uninterrupted run, and nn.SyncBatchNorm syncs over the replica group. Real gloo groups; the
model and the one-process references are in _buffers_worker.py. Spawning is slow here, so the
worlds run once per module (fixtures) and the tests read their results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer._buffers_worker import check, reference, reference_global, run_case
from tests.trainer._parallel_harness import World

pytestmark = pytest.mark.slow

STEPS = 3
PLAIN = ("ddp", "zero1", "zero2", "zero3")
SYNC = ("sync-ddp", "sync-zero1", "sync-zero3", "sync-pipeline")
Results = list[dict[str, Any]]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("buffers")


@pytest.fixture(scope="module")
def trained(checkpoints: Path) -> dict[str, Results]:
    """World 2: data_parallel and ZeRO-1/2/3; world 4: a 2-stage pipeline with 2 replicas (its
    replica r trains on the rows data_parallel's rank r does). Both at once."""
    two = [{"name": s, "strategy": s, "steps": STEPS, "save_to": str(checkpoints / s)} for s in PLAIN]
    two.append({"name": "ddp-off", "strategy": "ddp", "steps": STEPS, "broadcast_buffers": False})
    two += [
        {"name": f"sync-{s}", "strategy": s, "steps": STEPS, "sync_bn": True}
        for s in ("ddp", "zero1", "zero3")
    ]
    two += [{"name": f"timing-{s}", "strategy": s, "timing": True} for s in ("ddp", "zero1", "zero3")]
    four = [
        {
            "name": "pipeline",
            "strategy": "pipeline",
            "steps": STEPS,
            "save_to": str(checkpoints / "pipeline"),
        },
        {"name": "sync-pipeline", "strategy": "pipeline", "steps": STEPS, "sync_bn": True},
        {"name": "sync-pipeline-world", "strategy": "pipeline", "sync_bn": "world", "expect_error": True},
    ]
    worlds = World(2, two, run_case), World(4, four, run_case)
    results = [check(w.results()) for w in worlds]
    by_case = {name: results[0] for name in [c["name"] for c in two]}
    by_case |= {name: results[1] for name in [c["name"] for c in four]}
    return by_case


@pytest.fixture(scope="module")
def resumed(trained: dict[str, Results], checkpoints: Path) -> dict[str, Results]:
    """data_parallel and ZeRO resumed at world 3 and 1, the pipeline at world 2 (one replica);
    name@world -> the ranks' results."""

    def cases(names: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{"name": s, "strategy": s, "load_from": str(checkpoints / s)} for s in names]

    worlds = {
        3: World(3, cases(PLAIN), run_case),
        1: World(1, cases(("ddp", "zero3")), run_case),
        2: World(2, cases(("pipeline",)), run_case),
    }
    out: dict[str, Results] = {}
    for world, w in worlds.items():
        results = check(w.results())
        for name in results[0]:
            out[f"{name}@{world}"] = results
    return out


def _evals(results: Results, name: str) -> list[torch.Tensor]:
    """The ranks' eval outputs (a pipeline's: its last stages')."""
    return [r[name]["eval"] for r in results if r[name]["eval"] is not None]


def _reference(name: str) -> dict[str, Any]:
    # The pipeline runs each replica's rows in 2 micro-batches: BatchNorm per micro-batch.
    return reference(STEPS, world=2, microbatches=2 if name == "pipeline" else 1)


def _losses(results: Results, name: str) -> torch.Tensor:
    """The mean loss of each step over the ranks (the pipeline's step() returns it already)."""
    return torch.tensor([r[name]["losses"] for r in results]).mean(0)


@pytest.mark.parametrize("name", [*PLAIN, "pipeline"])
def test_eval_outputs_equal_on_every_rank(trained: dict[str, Results], name: str) -> None:
    evals = _evals(trained[name], name)
    assert len(evals) == 2
    assert _max_diff(evals[0], evals[1]) <= 1e-6, f"{name}: eval outputs differ between ranks"


@pytest.mark.parametrize("name", [*PLAIN, "pipeline"])
def test_losses_and_eval_match_one_process(trained: dict[str, Results], name: str) -> None:
    ref = _reference(name)
    assert _max_diff(_losses(trained[name], name), torch.tensor(ref["losses"])) <= 1e-5
    for out in _evals(trained[name], name):
        assert _max_diff(out, ref["eval"]) <= 1e-5, f"{name}: eval outputs differ from one process"


@pytest.mark.parametrize("name", [*PLAIN, "pipeline"])
def test_full_state_dict_has_rank0_buffers_on_every_rank(trained: dict[str, Results], name: str) -> None:
    ref = _reference(name)
    for rank, r in enumerate(trained[name]):
        for key, value in ref["buffers"].items():
            assert _max_diff(r[name]["full"][key], value) <= 1e-5, f"{name}, rank {rank}: {key}"


def test_broadcast_buffers_false_lets_the_ranks_part(trained: dict[str, Results]) -> None:
    evals = _evals(trained["ddp-off"], "ddp-off")
    assert _max_diff(evals[0], evals[1]) > 1e-3


@pytest.mark.parametrize("run", ["ddp@3", "zero1@3", "zero2@3", "zero3@3", "ddp@1", "zero3@1", "pipeline@2"])
def test_resume_evaluates_as_the_uninterrupted_run(
    trained: dict[str, Results], resumed: dict[str, Results], run: str
) -> None:
    name = run.split("@")[0]
    uninterrupted = _evals(trained[name], name)[0]
    for out in _evals(resumed[run], name):
        assert _max_diff(out, uninterrupted) <= 1e-6, f"{run}: resumed eval outputs"


@pytest.mark.parametrize("name", SYNC)
def test_sync_batchnorm_matches_one_process_on_the_global_batch(
    trained: dict[str, Results], name: str
) -> None:
    ref = reference_global(STEPS, replicas=2, microbatches=2 if name == "sync-pipeline" else 1)
    assert _max_diff(_losses(trained[name], name), torch.tensor(ref["losses"])) <= 1e-5
    evals = _evals(trained[name], name)
    assert len(evals) == 2
    for out in evals:
        assert _max_diff(out, ref["eval"]) <= 1e-5, f"{name}: eval outputs differ from one process"


def test_sync_batchnorm_over_another_group_is_refused_naming_the_alternative(
    trained: dict[str, Results],
) -> None:
    for r in trained["sync-pipeline-world"]:
        message = r["sync-pipeline-world"]["raised"]
        assert message.startswith("NotSupported: pipeline: SyncBatchNorm")
        assert "convert_sync_batchnorm(model) (no process_group)" in message


@pytest.mark.parametrize("name", ["timing-ddp", "timing-zero1", "timing-zero3"])
def test_buffers_broadcast_before_the_forwards_torch_ddp_does(trained: dict[str, Results], name: str) -> None:
    # train, no_grad, no_grad, train, train under no_sync, train, train: torch's DDP broadcasts
    # before the first forward and before one that follows a forward whose gradients it reduces
    # (require_forward_param_sync), so before forwards 1, 2, 5 and 7. ZeRO-2/3 reduce every
    # backward, no_sync included, so they broadcast before forward 6 too.
    expected = [1, 2, 2, 2, 3, 4, 5] if name == "timing-zero3" else [1, 2, 2, 2, 3, 3, 4]
    for r in trained[name]:
        assert r[name]["broadcasts"] == expected
