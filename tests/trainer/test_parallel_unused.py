"""No gradient stays no gradient (issue #40): a parameter that got no gradient on any rank keeps
`.grad = None` on every rank under data_parallel and fully_shard (ZeRO 1/2/3), so AdamW with
weight decay leaves it exactly as one process does; one used on some ranks only is averaged as
DDP does. A routed MoE (tests/trainer/unused_moe.py) in real gloo groups of 2 and 3 processes,
against one process running the unwrapped model on the global batch, with and without
gradient accumulation (no_sync)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from dtjob.trainer.train_state import TrainState
from tests.trainer import unused_moe
from tests.trainer._parallel_harness import relative_difference

pytestmark = pytest.mark.slow

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
ACCUMS = [1, 2]
CASES = [
    {"name": f"{s}-accum{a}", "strategy": s, "accum": a, "collective": "auto"}
    for s in STRATEGIES
    for a in ACCUMS
]
# The flags' all-reduce (a few dozen floats) on each of dtjob's own algorithms too.
CASES += [
    {"name": f"{s}-accum{a}-{c}", "strategy": s, "accum": a, "collective": c}
    for s, a, c in [("zero1", 2, "ring"), ("zero2", 1, "hd"), ("zero3", 2, "direct"), ("ddp", 2, "ring")]
]
# Never used, or not at all after the first step's first micro-step: AdamW must not touch them.
NEVER = ("unused.", "frozen.", ".experts.3.")
FIRST_STEP_ONLY = ".experts.2."


@cache
def _world(world: int) -> list[dict[str, Any]]:
    results = unused_moe.run_world(world, CASES)
    for rank, result in enumerate(results):
        for case in CASES:
            assert "error" not in result.get(case["name"], {}), (
                f"rank {rank}: {result[case['name']]['error']}"
            )
    return results


@cache
def _reference(accum: int, world: int) -> dict[str, Any]:
    return unused_moe.train(unused_moe.build(), accum, world, 0, wrapped=False)


def _params(names: list[str], *parts: str) -> list[str]:
    return [n for n in names if any(p in n for p in parts)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_no_gradient_stays_none_and_adamw_leaves_it_as_one_process(world: int, case: dict[str, Any]) -> None:
    ranks = [r[case["name"]] for r in _world(world)]
    ref = _reference(case["accum"], world)
    initial = unused_moe.build().state_dict()
    names = list(initial)

    # .grad is None after each step's backward on every rank exactly where one process has it.
    for rank, result in enumerate(ranks):
        assert result["none"] == ref["none"], f"rank {rank}"
    assert _params(ref["none"][0], "unused.", ".experts.3.") and _params(ref["none"][1], FIRST_STEP_ONLY)
    assert not _params(ref["none"][0], FIRST_STEP_ONLY)

    # Losses: each rank's mean over equal shares, averaged, is the global batch's mean.
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    assert torch.allclose(losses, torch.tensor(ref["losses"]), rtol=0, atol=1e-5), (losses, ref["losses"])

    for rank, result in enumerate(ranks):
        after_first, final = result["states"]
        # The never used: bit-identical to one process (and to their initial values).
        for n in _params(names, *NEVER):
            assert torch.equal(final[n], ref["states"][-1][n]), f"rank {rank}: {n} moved"
            assert torch.equal(final[n], initial[n]), f"rank {rank}: {n} moved"
        # Used in the first step only: untouched since, bit for bit, as in one process.
        for n in _params(names, FIRST_STEP_ONLY):
            assert torch.equal(final[n], after_first[n]), f"rank {rank}: {n} moved after step 0"
            assert torch.equal(ref["states"][-1][n], ref["states"][0][n])
        # Everything (expert 1: the last rank's tokens only) within 1e-5 of one process, relative.
        for n in names:
            diff = relative_difference(final[n], ref["states"][-1][n])
            assert diff < 1e-5, f"rank {rank}: {n} relative difference {diff:.2e}"


def test_a_checkpoint_with_never_stepped_parameters_loads() -> None:
    # A parameter whose .grad stayed None has no optimizer state (AdamW never stepped it): the
    # checkpoint has no "optim.<name>.exp_avg" for it, and loading must not ask for one.
    model = unused_moe.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=unused_moe.LR, weight_decay=unused_moe.WEIGHT_DECAY)
    x, y, route = unused_moe.micro_batch(2, 0, 0)
    torch.nn.functional.cross_entropy(model(x, route), y).backward()
    optimizer.step()
    saved = TrainState(model, optimizer)
    shards, extra = saved.state_shards(), saved.extra_state()
    assert "optim.unused.weight.exp_avg" not in shards and "optim.embed.weight.exp_avg" in shards

    def fetch(key: str, start: int, length: int) -> torch.Tensor:
        return shards[key].local[start : start + length]  # one process wrote every element

    fresh = unused_moe.build()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=unused_moe.LR)
    TrainState(fresh, fresh_optimizer).load(fetch, extra, {})
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        want, got = optimizer.state.get(p, {}), fresh_optimizer.state.get(q, {})
        assert set(got) == set(want), name
        for key in want:
            assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), f"{name}.{key}"
