"""3-D parallelism against one process running the unwrapped model (fp32, AdamW, 10 steps, global
batch of 4), world 4 on gloo: TP=2 x DP=2 with ZeRO-2 (and ZeRO-3) over the DP group, TP=2 x PP=2
(TP inside each pipeline stage), for HF GPT-2 (tied vocab-split wte/lm_head), HF Llama and a
user's own T5-like encoder with an explicit plan; the mesh's groups; the refusals. Every case of
one world runs in one spawned group (tests/trainer/_parallel_3d_cases.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trainer._parallel_3d_cases import reference, run_3d_world

MODELS = ("hf-gpt2", "hf-llama", "encoder")
# The encoder clips its gradients (max norm 0.3, below its norms: every step clips), so the norm
# over both dimensions (TP shards and DP or PP pieces) must be right too.
CLIP = {"encoder": 0.3}
TRAIN = [
    *(
        {
            "name": f"{m}-tp2-zero2",
            "kind": "train",
            "model": m,
            "dp": 2,
            "tp": 2,
            "pp": 1,
            "zero": 2,
            "clip": CLIP.get(m),
        }
        for m in MODELS
    ),
    *(
        {"name": f"{m}-tp2-pp2", "kind": "train", "model": m, "dp": 1, "tp": 2, "pp": 2, "clip": CLIP.get(m)}
        for m in MODELS
    ),
    {
        "name": "encoder-tp2-zero3",
        "kind": "train",
        "model": "encoder",
        "dp": 2,
        "tp": 2,
        "pp": 1,
        "zero": 3,
        "clip": 0.3,
    },
    {
        "name": "llama-tp2-zero3",
        "kind": "train",
        "model": "hf-llama",
        "dp": 2,
        "tp": 2,
        "pp": 1,
        "zero": 3,
        "clip": None,
    },
]


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    cases = [{"name": "mesh", "kind": "mesh"}, {"name": "errors", "kind": "errors"}, *TRAIN]
    return run_3d_world(4, cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN, ids=[c["name"] for c in TRAIN])
def test_3d_equals_one_process(world4: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """Losses of every step within 1e-5 relative, full_state_dict within 1e-4 of one process."""
    name = case["name"]
    for r, result in enumerate(world4):
        assert "error" not in result[name], f"rank {r}: {result[name]['error']}"
    want_losses, want_state = reference(case)
    for r, result in enumerate(world4):
        for step, (got, want) in enumerate(zip(result[name]["losses"], want_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name}: rank {r} step {step} loss {got} vs {want}"
        if case["clip"]:
            assert result[name]["norms"] == world4[0][name]["norms"], f"{name}: rank {r}'s norms differ"
    state = world4[0][name]["state"]
    assert list(state) == list(want_state), f"{name}: state dict keys differ"
    for key, want in want_state.items():
        assert state[key].shape == want.shape, (
            f"{name}: {key} {tuple(state[key].shape)} vs {tuple(want.shape)}"
        )
        diff = float((state[key] - want).norm() / want.norm().clamp_min(1e-12))
        assert diff < 1e-4, f"{name}: {key} relative difference {diff:.2e}"
    assert all(r[name]["state"] == {} for r in world4[1:]), (
        "full_state_dict returns the weights on rank 0 only"
    )


@pytest.mark.slow
def test_clipped_norm_counts_every_piece_once(world4: list[dict[str, Any]]) -> None:
    """The norm torch's clip_grad_norm_ returned under TP x ZeRO and TP x PP is one process's."""
    import torch

    from tests.trainer._parallel_3d_cases import batch, build, loss_of

    case = {"model": "encoder"}
    model = build(case)
    loss_of(model, *batch(case, 0), case, None).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for name in ("encoder-tp2-zero2", "encoder-tp2-pp2", "encoder-tp2-zero3"):
        got = world4[0][name]["norms"][0]
        assert abs(got - want) <= 1e-5 * want, f"{name}: step 0 norm {got} vs {want}"


@pytest.mark.slow
def test_mesh_groups_follow_megatron_order(world4: list[dict[str, Any]]) -> None:
    """TP groups are consecutive ranks (one pod), pipeline stages next, data parallel outermost."""
    rank2 = world4[2]["mesh"]
    assert rank2["1x2x2"] == {"coords": (0, 1, 0), "tp": [2, 3], "pp": [0, 2], "dp": [2], "dp_pp": [0, 2]}
    assert rank2["2x2x1"] == {"coords": (1, 0, 0), "tp": [2, 3], "pp": [2], "dp": [0, 2], "dp_pp": [0, 2]}
    assert rank2["2x1x2"] == {
        "coords": (1, 0, 0),
        "tp": [2],
        "pp": [2, 3],
        "dp": [0, 2],
        "dp_pp": [0, 1, 2, 3],
    }
    rank3 = world4[3]["mesh"]
    assert rank3["1x2x2"] == {"coords": (0, 1, 1), "tp": [2, 3], "pp": [1, 3], "dp": [3], "dp_pp": [1, 3]}
    assert rank3["1x4x1"]["tp"] == [0, 1, 2, 3] and rank3["1x4x1"]["coords"] == (0, 0, 3)


@pytest.mark.slow
def test_refusals_name_the_alternative(world4: list[dict[str, Any]]) -> None:
    errors = world4[0]["errors"]
    assert "dp=2 x tp=2 x pp=2 = 8 processes, but the world size is 4" in errors["sizes"]
    assert "dp must be a whole number >= 1, got 0" in errors["not_a_size"]
    assert "tp=4 must divide the processes per pod (LOCAL_WORLD_SIZE=2" in errors["tp_across_pods"]
    assert errors["tp_in_pod"] == "accepted"
    assert (
        "fully_shard: its group holds ranks [0, 1] of one tensor-parallel group"
        in errors["fully_shard_world"]
    )
    assert "mesh(...).dp" in errors["fully_shard_world"]
    assert "mixes ranks of different tensor-parallel coordinates" in errors["fully_shard_mixed"]
    assert "pipeline: its group holds ranks [0, 1]" in errors["pipeline_world"]
    assert "mesh(...).dp_pp" in errors["pipeline_world"]
    for wrapper in ("fsdp", "pipeline"):
        assert "save full_state_dict(model)" in errors[f"checkpoint_{wrapper}"]
