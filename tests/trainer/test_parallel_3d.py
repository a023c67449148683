"""3-D parallelism against one process running the unwrapped model (fp32, AdamW, 10 steps, global
batch of 4), on gloo: TP=2 x DP=2 with ZeRO-2 (and ZeRO-3) over the DP group, TP=2 x PP=2 (TP
inside each pipeline stage), DP=2 x TP=2 x PP=2 (world 8); TrainState checkpoints resumed at
another DP size (into and out of a TP x PP pipeline); for HF GPT-2 (tied vocab-split wte/lm_head),
HF Llama and a user's own T5-like encoder with an explicit plan; the mesh's groups; the
refusals. Every case of one world runs in one spawned group (tests/trainer/_parallel_3d_cases.py)."""

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


# TrainState checkpoints: saved after 4 steps at TP=2 x DP=2 (world 4), resumed at TP=2 x DP=1
# (world 2) for the remaining 6; the GPT-2 one also changes wrapper (data_parallel to ZeRO-2).
SAVED = [
    {"name": "encoder-save", "kind": "train", "model": "encoder", "dp": 2, "tp": 2, "pp": 1, "zero": 2},
    {
        "name": "hf-gpt2-save",
        "kind": "train",
        "model": "hf-gpt2",
        "dp": 2,
        "tp": 2,
        "pp": 1,
        "wrapper": "ddp",
    },
]
# A TP=2 x PP=2 pipeline's checkpoint (world 4) resumed by TP=2 x ZeRO-2 at world 2 (pipeline to
# fully_shard), and the ZeRO-2 one above resumed by a TP=2 x PP=2 pipeline (DP 2 -> 1, world 4).
SAVED.append({"name": "encoder-pp-save", "kind": "train", "model": "encoder", "dp": 1, "tp": 2, "pp": 2})
RESUMED = [
    {
        **c,
        "name": c["name"].replace("save", "resume"),
        "dp": 1,
        "pp": 1,
        "zero": 2,
        "wrapper": None,
        "start_step": 4,
    }
    for c in SAVED
]
PIPELINE_RESUMED = {**SAVED[0], "name": "encoder-resume-as-pp", "dp": 1, "pp": 2, "start_step": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-checkpoints")
    return {c["name"]: str(root / c["name"]) for c in SAVED}


@pytest.fixture(scope="module")
def world4(checkpoints: dict[str, str]) -> list[dict[str, Any]]:
    saved = [{**c, "steps": 4, "save_to": checkpoints[c["name"]]} for c in SAVED]
    resumed = {**PIPELINE_RESUMED, "load_from": checkpoints[SAVED[0]["name"]]}  # after its save
    cases = [{"name": "mesh", "kind": "mesh"}, {"name": "errors", "kind": "errors"}, *TRAIN, *saved, resumed]
    return run_3d_world(4, cases)


@pytest.fixture(scope="module")
def world2(world4: list[dict[str, Any]], checkpoints: dict[str, str]) -> list[dict[str, Any]]:
    for c in SAVED:
        assert "error" not in world4[0][c["name"]], world4[0][c["name"]]
    resumed = [{**c, "load_from": checkpoints[c["name"].replace("resume", "save")]} for c in RESUMED]
    return run_3d_world(2, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN, ids=[c["name"] for c in TRAIN])
def test_3d_equals_one_process(world4: list[dict[str, Any]], case: dict[str, Any]) -> None:
    check(world4, case)


def check(world: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """Losses of every step within 1e-5 relative, full_state_dict within 1e-4 of one process."""
    name = case["name"]
    for r, result in enumerate(world):
        assert "error" not in result[name], f"rank {r}: {result[name]['error']}"
    want_losses, want_state = reference(case)
    want_losses = want_losses[case.get("start_step", 0) :]
    for r, result in enumerate(world):
        assert len(result[name]["losses"]) == len(want_losses), (
            f"{name}: rank {r} ran another number of steps"
        )
        for step, (got, want) in enumerate(zip(result[name]["losses"], want_losses, strict=True)):
            assert abs(got - want) <= 1e-5 * abs(want), f"{name}: rank {r} step {step} loss {got} vs {want}"
        if case["clip"]:
            assert result[name]["norms"] == world[0][name]["norms"], f"{name}: rank {r}'s norms differ"
    state = world[0][name]["state"]
    assert list(state) == list(want_state), f"{name}: state dict keys differ"
    for key, want in want_state.items():
        assert state[key].shape == want.shape, (
            f"{name}: {key} {tuple(state[key].shape)} vs {tuple(want.shape)}"
        )
        diff = float((state[key] - want).norm() / want.norm().clamp_min(1e-12))
        assert diff < 1e-4, f"{name}: {key} relative difference {diff:.2e}"
    assert all(r[name]["state"] == {} for r in world[1:]), (
        "full_state_dict returns the weights on rank 0 only"
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", RESUMED, ids=[c["name"] for c in RESUMED])
def test_checkpoint_resumes_at_another_dp_size(world2: list[dict[str, Any]], case: dict[str, Any]) -> None:
    """Steps 4-9 after the resume equal steps 4-9 of one process's uninterrupted run."""
    check(world2, {**case, "clip": None})


@pytest.mark.slow
def test_a_pipeline_resumes_a_zero2_checkpoint_at_another_dp_size(world4: list[dict[str, Any]]) -> None:
    """TP=2 x DP=2 ZeRO-2's step-4 checkpoint, loaded by a TP=2 x PP=2 pipeline (DP 1): steps 4-9
    equal one process's."""
    check(world4, {**PIPELINE_RESUMED, "clip": None})


THREE_D = [
    {"name": "encoder-3d", "kind": "train", "model": "encoder", "dp": 2, "tp": 2, "pp": 2, "clip": 0.3},
    {"name": "hf-gpt2-3d", "kind": "train", "model": "hf-gpt2", "dp": 2, "tp": 2, "pp": 2, "clip": None},
]


@pytest.fixture(scope="module")
def world8() -> list[dict[str, Any]]:
    """DP=2 x TP=2 x PP=2: each TP coordinate's pipeline has two replicas (world 8)."""
    return run_3d_world(8, THREE_D)


@pytest.mark.slow
@pytest.mark.parametrize("case", THREE_D, ids=[c["name"] for c in THREE_D])
def test_dp2_tp2_pp2_equals_one_process(world8: list[dict[str, Any]], case: dict[str, Any]) -> None:
    check(world8, case)


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
    assert errors["checkpoint_pipeline"] == "accepted"  # TP-qualified names, as fully_shard's
    assert errors["checkpoint_fsdp"] == "accepted"
    assert "checkpoints of a tensor_parallel model on its own" in errors["checkpoint_bare"]
    assert "save full_state_dict(model)" in errors["checkpoint_bare"]
    assert "written at tensor-parallel size 4, this model's is 2" in errors["checkpoint_other_tp"]
    assert "convert it through full_state_dict" in errors["checkpoint_other_tp"]
