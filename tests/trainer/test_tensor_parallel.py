"""tensor_parallel against one process running the unwrapped model (fp32, AdamW, 10 steps): HF
GPT-2 (fused c_attn, tied vocab-split wte/lm_head), HF Llama and a user's own transformer with an
explicit plan, at TP=2 (world 2), TP=2 x DP=2 and TP=4 (world 4); the vocab-parallel cross-entropy
against F.cross_entropy; refused plans. Real gloo groups (tests/trainer/_tp_cases.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.trainer._tp_cases import reference, run_tp_world

MODELS = ("hf-gpt2", "hf-llama", "tiny-lm")
# The user's model clips its gradients (max norm 0.5: every step clips, the norms are 1-3).
TRAIN = [
    {"name": f"{m}-tp2", "kind": "train", "model": m, "tp": 2, "clip": 0.5 if m == "tiny-lm" else None}
    for m in MODELS
]


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    cases = [{"name": "ce", "kind": "ce"}, {"name": "errors", "kind": "errors"}, *TRAIN]
    return run_tp_world(2, cases)


def check_training(results: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """Losses of every step within 1e-5 relative, full_state_dict within 1e-4 of one process."""
    name = case["name"]
    for r, result in enumerate(results):
        assert "error" not in result[name], f"rank {r}: {result[name]['error']}"
    want_losses, want_state = reference(case)
    dp = len(results) // case["tp"]
    # Each data-parallel replica's loss is of its part of the batch: their mean is the batch's.
    got_losses = [sum(results[d * case["tp"]][name]["losses"][s] for d in range(dp)) / dp for s in range(10)]
    if case["clip"]:
        for r, result in enumerate(results):
            assert result[name]["norms"] == results[0][name]["norms"], (
                f"{name}: rank {r}'s gradient norms differ"
            )
    for step, (got, want) in enumerate(zip(got_losses, want_losses, strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"{name}: step {step} loss {got} vs {want}"
    state = results[0][name]["state"]
    assert list(state) == list(want_state), f"{name}: state dict keys differ"
    for key, want in want_state.items():
        assert state[key].shape == want.shape, (
            f"{name}: {key} {tuple(state[key].shape)} vs {tuple(want.shape)}"
        )
        diff = float((state[key] - want).norm() / want.norm().clamp_min(1e-12))
        assert diff < 1e-4, f"{name}: {key} relative difference {diff:.2e}"
    assert results[1][name]["state"] == {}, "full_state_dict returns the weights on rank 0 only"


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN, ids=[c["name"] for c in TRAIN])
def test_tp2_equals_one_process(world2: list[dict[str, Any]], case: dict[str, Any]) -> None:
    check_training(world2, case)


@pytest.mark.slow
def test_parameters_are_local_shards_with_their_names(world2: list[dict[str, Any]]) -> None:
    shapes = world2[0]["hf-gpt2-tp2"]["local_shapes"]
    assert shapes["transformer.wte.weight"] == (48, 32)  # vocab 96 / 2, tied lm_head the same object
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (32, 48)  # Conv1D (in, 3 * 32 / 2)
    assert shapes["transformer.h.0.attn.c_proj.weight"] == (16, 32)  # rowwise: input rows split
    assert shapes["transformer.h.0.attn.c_proj.bias"] == (32,)  # added once, whole
    llama = world2[0]["hf-llama-tp2"]["local_shapes"]
    assert llama["model.layers.0.self_attn.k_proj.weight"] == (8, 32)  # 1 of 2 kv heads of 8
    assert llama["model.layers.0.mlp.down_proj.weight"] == (32, 32)


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_equals_cross_entropy(world2: list[dict[str, Any]]) -> None:
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, 5, 10, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, 10, (3, 5), generator=g)
    targets[0, 1] = targets[2, 4] = -100
    for reduction in ("mean", "sum", "none"):
        want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
        want = want.view(targets.shape) if reduction == "none" else want
        weights = torch.arange(want.numel(), dtype=want.dtype).view(want.shape) + 1
        (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
        for r in range(2):
            loss, grad = world2[r]["ce"][reduction]
            torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad, want_grad.chunk(2, -1)[r], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_refused_plans_name_the_field(world2: list[dict[str, Any]]) -> None:
    errors = world2[0]["errors"]
    assert "'blocks.*.mlp.up' matches no module" in errors["no_match"]
    assert (
        "blocks.0.attn.q.weight has 21 rows along dimension 0, not divisible into 2 ranks (the TP size)"
        in (errors["indivisible"])
    )
    assert "blocks.0.drop is a dropout with p=0.1" in errors["dropout"]
    assert "plan=" in errors["auto_unknown"] and "TinyLM" in errors["auto_unknown"]
    assert "unknown kind 'columnwise'" in errors["bad_kind"]
    assert "'emb' is an nn.Embedding" in errors["embedding_colwise"]
    assert "emb.weight is tied to head.weight" in errors["half_tied"] and "add 'emb'" in errors["half_tied"]
    assert "'blocks.0.ln1' is a LayerNorm" in errors["not_linear"]
    # Wrappers whose result would be silently wrong (rank 0's shards broadcast over the others).
    assert "holds ranks [0, 1] of one tensor-parallel group; pass group=" in errors["dp_over_tp_group"]
    # fully_shard over the DP group is supported now (test_parallel_3d.py); over the world it mixes shards.
    assert "fully_shard: its group holds ranks [0, 1] of one tensor-parallel group" in errors["fully_shard"]
    assert "save full_state_dict(model)" in errors["checkpoint"]
    assert "generate() of a tensor_parallel model" in errors["generate"]


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    """TP=2 x DP=2 for every model, and TP=4 for the user's model (GPT-2's 2 and Llama's 2 kv
    heads do not split 4 ways)."""
    tp4 = {"name": "tiny-lm-tp4", "kind": "train", "model": "tiny-lm", "tp": 4, "clip": 0.5}
    return run_tp_world(4, [*({**c, "name": c["name"] + "-dp2"} for c in TRAIN), tp4])


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN, ids=[c["name"] + "-dp2" for c in TRAIN])
def test_tp2_by_dp2_equals_one_process(world4: list[dict[str, Any]], case: dict[str, Any]) -> None:
    check_training(world4, {**case, "name": case["name"] + "-dp2"})


@pytest.mark.slow
def test_tp4_equals_one_process(world4: list[dict[str, Any]]) -> None:
    check_training(world4, {"name": "tiny-lm-tp4", "model": "tiny-lm", "tp": 4, "clip": 0.5})
