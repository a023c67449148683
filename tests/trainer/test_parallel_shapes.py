"""Parameters keep their name and shape under every ZeRO stage (issue #40): fully_shard gives
each rank rows of each parameter (fsdp/flat.py), so code that groups parameters by `p.dim()` -
nanoGPT's `configure_optimizers`, weight decay for matrices only - trains exactly as in one
process. Real gloo groups of 2 and 3 processes against one process on the global batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.trainer._shapes_cases import SEQ, VOCAB, relative_difference, run_shapes_world, train_reference

pytestmark = pytest.mark.slow

CASES = [
    {
        "name": f"zero{stage}-{'foreach' if foreach else 'loop'}",
        "stage": stage,
        "foreach": foreach,
        "clip": 0.5,
    }
    for stage in (1, 2, 3)
    for foreach in (True, False)
] + [
    {
        "name": f"zero{stage}-sgd-{foreach}",
        "stage": stage,
        "foreach": foreach,
        "clip": 0.5,
        "optimizer": "sgd",
    }
    for stage in (1, 3)
    for foreach in (True, False)
]


# Mixed precision: autocast's rounding depends on how the batch is split, so these are compared
# with one process as test_parallel_data's lossy cases are: losses and the whole parameter vector
# within 2% (bf16's 8-bit mantissa, ~4e-3 relative, over 4 AdamW steps: 1.4e-2 on one matrix). What
# they check is that the scaler and clipping work on DTensor gradients: an error, or a skipped or
# doubled step, is far outside.
LOSSY = [
    {"name": f"zero{stage}-{precision}", "stage": stage, "foreach": True, "clip": 0.5, "precision": precision}
    for stage in (2, 3)
    for precision in ("fp16", "bf16")
]


def _rows_owned(rows: int, rank: int, size: int) -> int:
    chunk = -(-rows // size)  # torch.chunk's size, as FSDP2
    return max(0, min(rows, (rank + 1) * chunk) - min(rows, rank * chunk))


def _check_shapes(results: list[dict[str, Any]], name: str) -> None:
    """Names, shapes and dim() are the unwrapped model's; each is a DTensor whose local tensor is
    the rows this rank owns (a 0-dim parameter: replicated, whole on every rank)."""
    size = len(results)
    for rank, result in enumerate(results):
        expected = result[name]["expected"]
        for seen in (result[name]["seen"], result[name]["seen_after"]):
            assert [(n, shape, dim) for n, shape, dim, _ in seen] == [e[:3] for e in expected], name
            for n, shape, _, local in seen:
                rows = (_rows_owned(shape[0], rank, size), *shape[1:]) if shape else ()
                assert local == rows, f"{name}: rank {rank} holds {local} of {n} {shape}, not {rows}"


def _check_training(results: list[dict[str, Any]], case: dict[str, Any], tolerance: float = 1e-5) -> None:
    name = case["name"]
    for rank, result in enumerate(results):
        assert "error" not in result[name], f"rank {rank}: {result[name]['error']}"
    ref_losses, ref_state = train_reference(case)
    losses = results[0][name]["losses"]
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(got - want) <= tolerance * abs(want), (
            f"{name}: step {step} loss {got} vs one process {want}"
        )
    state = results[0][name]["state"]
    assert state.keys() == ref_state.keys()
    if tolerance > 1e-5:  # lossy: the whole vector
        got_all = torch.cat([state[k].reshape(-1) for k in ref_state])
        want_all = torch.cat([v.reshape(-1) for v in ref_state.values()])
        diff = relative_difference(got_all, want_all)
        assert diff < tolerance, f"{name}: parameters differ from one process by {diff:.2e} (relative)"
        return
    for key, want in ref_state.items():
        assert state[key].shape == want.shape, key
        diff = relative_difference(state[key], want)
        assert diff < tolerance, f"{name}: {key} differs from one process by {diff:.2e} (relative)"


@pytest.mark.parametrize("size", [2, 3])
def test_nanogpt_configure_optimizers_trains_as_one_process_under_every_zero_stage(size: int) -> None:
    assert VOCAB % 2 and SEQ % 2  # rows that do not split evenly: padding on some ranks
    results = run_shapes_world(size, CASES + LOSSY)
    for case in CASES:
        _check_training(results, case)
        _check_shapes(results, case["name"])
    for case in LOSSY:
        _check_training(results, case, tolerance=2e-2)
