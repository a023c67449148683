"""bench/memory3d.py's per-rank memory figures, checked to the byte where the answer is known
(issue #44): a GPT-2 of Ψ = 67,008 parameters (28 tensors, every first dimension even, so ZeRO's
shards at world 2 need no row padding), AdamW, fp32, one real gloo world of 2 running every
combination below, as the bench runs them.

What each rank must hold after a step, n = 28 parameter tensors, N = 2:
- DDP: 4Ψ parameters, 4Ψ + 4n gradients (one has-a-gradient flag per parameter rides in the last
  bucket), 8Ψ + 4n optimizer state (AdamW's exp_avg, exp_avg_sq and a float32 step per tensor);
- ZeRO-1: 4Ψ, 4Ψ full gradients + 4Ψ/N shard gradients, 8Ψ/N + 4n;
- ZeRO-2: 4Ψ, 4Ψ/N, 8Ψ/N + 4n; ZeRO-3: 4Ψ/N, 4Ψ/N, 8Ψ/N + 4n;
- ZeRO-3 + offload: 4Ψ/N on the device, and 4Ψ/N master + 4Ψ/N gradients + 8Ψ/N + 4n on the host;
- TP=2: the split tensors halved, the replicated ones (layer norms, position embedding, the
  row-parallel projections' biases) whole;
- PP=2: each stage its own blocks, the tied embedding on both ends.
"""

from __future__ import annotations

import math
import sys
from functools import cache
from typing import Any

import pytest

from tests.trainer.runtime_gang import REPO

sys.path.insert(0, str(REPO / "bench"))
import memory3d

pytestmark = pytest.mark.slow

N = 2
CFG = memory3d.ModelConfig(width=48, layers=2, heads=2, vocab=200, seq=16, batch=4)
COMBOS = {
    "DDP": memory3d.Combo("DDP", dp=N),
    "ZeRO-1": memory3d.Combo("ZeRO-1", dp=N, wrapper="zero", zero=1),
    "ZeRO-2": memory3d.Combo("ZeRO-2", dp=N, wrapper="zero", zero=2),
    "ZeRO-3": memory3d.Combo("ZeRO-3", dp=N, wrapper="zero", zero=3),
    "offload": memory3d.Combo("offload", dp=N, wrapper="zero", zero=3, offload="optimizer"),
    "TP2": memory3d.Combo("TP2", tp=N),
    "PP2": memory3d.Combo("PP2", pp=N, wrapper="pipeline"),
}


@cache
def _measured() -> dict[str, list[dict[str, Any]]]:
    return memory3d.run_world(N, list(COMBOS.values()), CFG)


@cache
def _shapes() -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in memory3d.build(CFG).named_parameters()}


def _numel(names: list[str]) -> int:
    return sum(math.prod(_shapes()[name]) for name in names)


PSI = 67_008
TENSORS = 28


def test_the_model_is_what_the_expectations_assume() -> None:
    assert memory3d.parameter_count(CFG) == _numel(list(_shapes())) == PSI
    assert len(_shapes()) == TENSORS
    assert all(shape[0] % N == 0 for shape in _shapes().values())


def _check(name: str, want: dict[str, int]) -> None:
    for rank, got in enumerate(_measured()[name]):
        for category, nbytes in want.items():
            assert got[category] == nbytes, f"{name}, rank {rank}, {category}: {got[category]} != {nbytes}"
        assert got["total"] == sum(got[c] for c in memory3d.CATEGORIES)
        assert got["peak"] >= got["total"]


def _bytes(params: int, grads: int, optimizer: int, host: int = 0) -> dict[str, int]:
    return {"params": params, "grads": grads, "optimizer": optimizer, "host": host}


STEPS = 4 * TENSORS  # AdamW's float32 step per tensor; also DDP's gradient flags
EXPECTED = {
    "DDP": _bytes(4 * PSI, 4 * PSI + STEPS, 8 * PSI + STEPS),
    "ZeRO-1": _bytes(4 * PSI, 4 * PSI + 4 * PSI // N, 8 * PSI // N + STEPS),
    "ZeRO-2": _bytes(4 * PSI, 4 * PSI // N, 8 * PSI // N + STEPS),
    "ZeRO-3": _bytes(4 * PSI // N, 4 * PSI // N, 8 * PSI // N + STEPS),
    "offload": _bytes(4 * PSI // N, 0, 0, host=16 * PSI // N + STEPS),
}


@pytest.mark.parametrize(("name", "want"), list(EXPECTED.items()), ids=list(EXPECTED))
def test_data_parallel_and_zero_hold_the_formulas_bytes(name: str, want: dict[str, int]) -> None:
    _check(name, want)
    # The bench's prediction: the same, less AdamW's steps and the gradient flags (and ZeRO-1's
    # shard gradients beside its full ones), which the README's formulas leave out.
    formula = COMBOS[name].formula(PSI)
    assert formula["params"] == want["params"]
    assert want["optimizer"] + want["host"] - formula["optimizer"] - formula["host"] == STEPS
    assert 0 <= want["grads"] - formula["grads"] in (0, STEPS, 4 * PSI // N)


def test_tensor_parallel_halves_the_split_tensors_and_keeps_the_replicated_ones() -> None:
    kept_whole = (".ln_", "transformer.ln_f.", "transformer.wpe.", "c_proj.bias")
    replicated = [n for n in _shapes() if any(part in n for part in kept_whole)]
    split = [n for n in _shapes() if n not in replicated]
    local = _numel(split) // N + _numel(replicated)
    # data_parallel over the mesh's DP group of 1 still carries its gradient flags.
    _check(
        "TP2", {"params": 4 * local, "grads": 4 * local + 4 * TENSORS, "optimizer": 8 * local + 4 * TENSORS}
    )
    assert COMBOS["TP2"].formula(PSI)["params"] == 4 * PSI / N < 4 * local


def test_each_pipeline_stage_holds_its_blocks_and_the_tied_embedding() -> None:
    names = list(_shapes())
    first = [n for n in names if n.startswith(("transformer.wte", "transformer.wpe", "transformer.h.0."))]
    last = [n for n in names if n.startswith(("transformer.h.1.", "transformer.ln_f"))] + [
        "transformer.wte.weight"
    ]
    for rank, stage in enumerate((first, last)):
        psi = _numel(stage)
        got = _measured()["PP2"][rank]
        assert (got["params"], got["grads"]) == (4 * psi, 4 * psi), f"stage {rank}"
        assert got["optimizer"] == 8 * psi + 4 * len(stage), f"stage {rank}"
