"""pipeline on real models (issue #40): a Hugging Face T5, frozen and unused parameters and a
top-1 mixture of experts, evaluation inside a training loop, and splits that cannot work.

Real gloo groups of 2 (and 4: 2 stages x 2 replicas) processes, against one process training the
unwrapped model on the global batch (see _pipeline_models.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.trainer import _pipeline_models as pm

pytestmark = pytest.mark.slow

TOL = 1e-5
WORLD2 = ("t5", "sparse", "eval", "auto_split")


def _results(world: int, checks: tuple[str, ...], name: str) -> list[dict[str, Any]]:
    per_rank = [r.get(name, {"error": f"not run: {sorted(r)}"}) for r in pm.run(world, checks)]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return per_rank


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        diff = float((got[key] - value).abs().max())
        assert diff <= tol, f"{key}: differs by {diff:.3g} from one process"


def test_t5_two_stages_matches_one_process() -> None:
    """Tied embeddings, relative position bias (a non-contiguous view crossing the boundary at
    decoder.block.1, with its gradient coming back), AdamW, 3 steps."""
    losses, weights = pm.t5_reference()
    for rank, result in enumerate(_results(2, WORLD2, "t5")):
        for step, (got, want) in enumerate(zip(result["losses"], losses, strict=True)):
            assert abs(got - want) <= TOL, f"rank {rank} step {step}: loss {got} vs {want}"
    _close(_results(2, WORLD2, "t5")[0]["weights"], weights)


def _check_sparse(per_rank: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    stages = 2
    for rank, result in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
            assert abs(got - want) <= TOL, f"rank {rank} step {step}: loss {got} vs {want}"
        # After backward, exactly the parameters without a gradient in one process have None.
        for step, (got_none, want_none) in enumerate(
            zip(result["grads_none"], reference["grads_none"], strict=True)
        ):
            owned = set(result["owned"])
            assert got_none == [n for n in want_none if n in owned], f"rank {rank} step {step}"
        assert rank % stages == 0 or "unused.weight" in result["owned"]
    # The reference: frozen and unused layers, expert 3 (never chosen) have no gradient.
    assert {"frozen.weight", "unused.weight", "blocks.0.experts.3.weight"} <= set(reference["grads_none"][0])
    weights = per_rank[0]["weights"]  # full_state_dict: frozen parameters included
    _close(weights, reference["weights"])
    never = ["frozen.weight", "frozen.bias", "unused.weight", "unused.bias"]
    never += [f"blocks.{b}.experts.3.{k}" for b in (0, 1) for k in ("weight", "bias")]
    for key in never:  # bit-identical: never updated, as in one process
        assert torch.equal(weights[key], reference["weights"][key]), key


def test_frozen_unused_and_idle_experts_two_stages() -> None:
    _check_sparse(_results(2, WORLD2, "sparse"), pm.moe_reference())


def test_frozen_unused_and_idle_experts_two_stages_two_replicas() -> None:
    _check_sparse(_results(4, ("sparse",), "sparse"), pm.moe_reference())


def test_eval_step_inside_a_training_loop_matches_the_unwrapped_model() -> None:
    reference = pm.moe_reference(evaluate=True)
    per_rank = _results(2, WORLD2, "eval")
    for rank, result in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(result["evals"], reference["evals"], strict=True)):
            assert got is not None and abs(got - want) <= TOL, (
                f"rank {rank} step {step}: eval {got} vs {want}"
            )
        for message in result["no_grad_errors"]:
            assert "eval_step" in message, f"rank {rank}: step() under no_grad gave {message!r}"
    assert all(out is None for out in per_rank[0]["logits"])  # stage 0 has no outputs
    for got, want in zip(per_rank[1]["logits"], reference["logits"], strict=True):
        assert float((got - want).abs().max()) <= TOL
    _close(per_rank[0]["weights"], reference["weights"])  # evaluation changed no training


def test_auto_split_where_a_model_output_crosses_says_how_to_split() -> None:
    per_rank = _results(2, WORLD2, "auto_split")
    for rank, result in enumerate(per_rank):
        error = result["raised"]
        assert error is not None and "BaseModelOutput" in error and "split=[" in error, (
            f"rank {rank}: {error}"
        )
