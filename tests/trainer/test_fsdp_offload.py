"""ZeRO-Offload (issue #44): fully_shard(offload="optimizer") keeps the master weights, their
gradients and the user's optimizer state on the host and steps there, with results identical to
the same stage without offload and equal to one process on the global batch. A small vision
transformer (tests/trainer/fsdp_offload_worker.py) in real gloo groups of 2 and 3, AdamW with
weight decay and gradient clipping, fp32 (and bf16 / fp16 autocast against the device run), 10
steps, on dtjob's ring collectives (deterministic; "auto" may pick another summation order per
run)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from tests.trainer import fsdp_offload_worker as worker

pytestmark = pytest.mark.slow

STAGES = [1, 2, 3]
OFFLOADS = [None, "optimizer"]


def _training(
    stage: int, offload: str | None, accum: int = 1, precision: str | None = None
) -> dict[str, Any]:
    name = f"zero{stage}-{offload or 'device'}-accum{accum}" + (f"-{precision}" if precision else "")
    case = {"name": name, "kind": "training", "stage": stage, "offload": offload, "accum": accum}
    return {**case, "precision": precision}


CASES = [_training(s, o) for s in STAGES for o in OFFLOADS]
# Gradient accumulation: a second backward adds its shard to the host gradients (a blocking copy).
ACCUM_CASES = [_training(s, "optimizer", accum=2) for s in STAGES]
# Mixed precision (autocast; fp16 with torch's ShardedGradScaler unscaling the host gradients).
PRECISIONS = [(2, "bf16"), (3, "fp16")]
PRECISION_CASES = [_training(s, o, precision=p) for s, p in PRECISIONS for o in OFFLOADS]
# Checkpoint of an offloaded ZeRO-3 model, resumed offloaded and at ZeRO-2 on the device.
RESUME = {(3, "optimizer"): "resume-zero3-offload", (2, None): "resume-zero2-device"}
RESUME_CASES = [{"name": n, "kind": "resume", "resume": r} for r, n in RESUME.items()]
MEMORY_CASES = [{"name": f"memory-{o or 'device'}", "kind": "memory", "offload": o} for o in OFFLOADS]
ALL = [
    *CASES,
    *ACCUM_CASES,
    *PRECISION_CASES,
    *RESUME_CASES,
    *MEMORY_CASES,
    {"name": "refusals", "kind": "refusals"},
]


@cache
def _world(world: int) -> list[dict[str, Any]]:
    results = worker.run_world(world, ALL)
    for rank, result in enumerate(results):
        for case in ALL:
            got = result.get(case["name"], {"error": "did not run (an earlier case failed)"})
            assert "error" not in got, f"rank {rank}, {case['name']}: {got['error']}"
    return results


@cache
def _reference(accum: int) -> tuple[list[float], dict[str, Any]]:
    return worker.train_reference(accum)


def _ranks(world: int, name: str) -> list[dict[str, Any]]:
    return [r[name] for r in _world(world)]


def _check_against_one_process(ranks: list[dict[str, Any]], accum: int) -> None:
    ref_losses, ref_state = _reference(accum)
    losses = worker.mean_losses(ranks)
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} against {want}"
    for rank, result in enumerate(ranks):
        assert result["state"].keys() == ref_state.keys()
        for key, want in ref_state.items():
            diff = worker.relative(result["state"][key], want)
            assert diff <= 1e-5, f"rank {rank}, {key}: {diff:.2e} relative"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_offload_gives_the_same_losses_as_the_device_and_as_one_process(world: int, stage: int) -> None:
    device = _ranks(world, _training(stage, None)["name"])
    offloaded = _ranks(world, _training(stage, "optimizer")["name"])
    for rank in range(world):  # identical: the same arithmetic, on other memory
        assert offloaded[rank]["losses"] == device[rank]["losses"], f"rank {rank}"
    _check_against_one_process(device, 1)
    _check_against_one_process(offloaded, 1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("stage", "precision"), PRECISIONS)
def test_offload_under_mixed_precision_gives_the_same_losses_as_the_device(
    world: int, stage: int, precision: str
) -> None:
    device = _ranks(world, _training(stage, None, precision=precision)["name"])
    offloaded = _ranks(world, _training(stage, "optimizer", precision=precision)["name"])
    for rank in range(world):
        assert offloaded[rank]["losses"] == device[rank]["losses"], f"rank {rank}"
        for key, want in device[rank]["state"].items():
            assert torch.equal(offloaded[rank]["state"][key], want), f"rank {rank}, {key}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_offload_accumulates_gradients_over_backward_passes(world: int, stage: int) -> None:
    _check_against_one_process(_ranks(world, _training(stage, "optimizer", accum=2)["name"]), 2)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("resume", list(RESUME), ids=list(RESUME.values()))
def test_an_offloaded_checkpoint_resumes_exactly(world: int, resume: tuple[int, str | None]) -> None:
    """Saved after 5 of 10 steps (TrainState: master weights and AdamW's moments from the host),
    loaded into a fresh model: the losses are the uninterrupted offloaded run's."""
    resumed = _ranks(world, RESUME[resume])
    uninterrupted = _ranks(world, _training(3, "optimizer")["name"])
    for rank in range(world):
        assert resumed[rank]["losses"] == uninterrupted[rank]["losses"], f"rank {rank}"
    _check_against_one_process(resumed, 1)


@pytest.mark.parametrize("world", [2, 3])
def test_offload_leaves_the_device_the_parameters_and_moves_the_rest_to_the_host(world: int) -> None:
    """ZeRO-3, fp32, bytes per rank (see fsdp_offload_worker for what "device" means on a CPU).
    Between steps the device holds the parameter shards (4 bytes per owned parameter and the
    rows' padding, the README's 4Ψ/N in fp32) and the grad flags; the host the master shard (4Ψ/N)
    and AdamW's moments and steps (8Ψ/N), the README's 12Ψ/N; after backward the gradient shards
    (4Ψ/N) are on the host too."""
    device = _ranks(world, "memory-device")
    offloaded = _ranks(world, "memory-optimizer")
    for rank in range(world):
        on, off = device[rank], offloaded[rank]
        shard, optim = off["shard_bytes"], off["optimizer_bytes"]
        assert optim >= 8 * off["owned"]  # exp_avg and exp_avg_sq, plus a 4-byte step each
        # Nothing on the host without offload.
        assert on["between"]["host"] == on["after_backward"]["host"] == 0
        # Host: master shard + optimizer state; after backward also the gradient shard.
        assert off["between"]["host"] == shard + optim
        assert off["after_backward"]["host"] == 2 * shard + optim
        # Device: what the device run holds less the optimizer state, and after backward less
        # the gradients too.
        assert off["between"]["device"] == on["between"]["device"] - optim
        assert off["after_backward"]["device"] == on["after_backward"]["device"] - optim - shard
        # Between steps: the shards and the flags; after backward nothing more (the gradients
        # went to the host as each unit's reduce-scatter finished, the units were freed).
        assert off["between"]["device"] == off["after_backward"]["device"] == shard + off["flag_bytes"]
        assert 4 * off["params"] / world <= shard <= 4 * off["params"] / world + off["padding_bound"]


@pytest.mark.parametrize("world", [2, 3])
def test_unsupported_offloads_raise_naming_the_alternative(world: int) -> None:
    messages = _ranks(world, "refusals")[0]["messages"]
    assert set(messages) == {"params", "cpu", "True"}
    assert 'offload="optimizer"' in messages["params"]
    for value in ("cpu", "True"):
        assert '"optimizer"' in messages[value]
