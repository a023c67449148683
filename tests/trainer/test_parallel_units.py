"""Pure pieces of the parallel strategies: schedules, stage split, buckets, config validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtjob.trainer.models import GPT, MLP, GPTConfig, MLPConfig
from dtjob.trainer.parallel import ParallelConfig, parallelize
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.common import blocks_in_order, parameter_shared_across, split_batch, split_range
from dtjob.trainer.parallel.ddp import assign_buckets
from dtjob.trainer.parallel.ddp.buckets import MiB
from dtjob.trainer.parallel.pipeline import Action, schedule_actions, split_stages


def _peak_in_flight(actions: list[Action]) -> int:
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 4), (4, 4), (4, 8), (4, 2), (3, 5)])
def test_schedules_run_each_microbatch_forward_then_backward(
    schedule: str, stages: int, microbatches: int
) -> None:
    for stage in range(stages):
        actions = schedule_actions(schedule, stage, stages, microbatches)
        forwards = [m for k, m in actions if k == "F"]
        backwards = [m for k, m in actions if k == "B"]
        assert forwards == list(range(microbatches)) and backwards == list(range(microbatches))
        for m in range(microbatches):
            assert actions.index(Action("F", m)) < actions.index(Action("B", m))
        peak = _peak_in_flight(actions)
        if schedule == "gpipe":
            assert peak == microbatches
        else:
            assert peak == min(stages - stage, microbatches) <= stages


def test_unknown_schedule_is_rejected() -> None:
    with pytest.raises(ValueError, match="schedule"):
        schedule_actions("interleaved", 0, 2, 4)


def test_split_stages_is_contiguous_and_balanced() -> None:
    assert split_stages(6, 4) == [(0, 1), (1, 2), (2, 4), (4, 6)]  # at most ceil(6 / 4) blocks each
    assert split_stages(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # Balanced by cost: a GPT's light embedding and head join their neighbouring blocks.
    assert split_stages(6, 4, [4, 20, 20, 20, 20, 3]) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert split_stages(3, 2, [1, 1, 10]) == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match="pipeline_stages=5 exceeds the model's 4 blocks"):
        split_stages(4, 5)


def test_buckets_first_small_then_capped_in_given_order() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (100_000, 200_000, 50_000, 3_000_000, 10)]
    # 4-byte floats: 0.4 MB, 0.8 MB, 0.2 MB, 12 MB, 40 B
    groups = assign_buckets(params, 1 * MiB, 4 * MiB)
    assert [[p.numel() for p in g] for g in groups] == [[100_000], [200_000, 50_000], [3_000_000], [10]]
    assert [p for g in groups for p in g] == params
    with pytest.raises(ValueError, match="ddp_first_bucket_mb"):
        assign_buckets(params, 0, MiB)


def test_split_range_covers_every_element_once() -> None:
    for numel in (0, 1, 5, 12, 13):
        for size in (1, 2, 3, 4):
            ranges = [split_range(numel, r, size) for r in range(size)]
            covered = [i for lo, hi in ranges for i in range(lo, hi)]
            assert covered == list(range(numel))


def test_split_batch_names_the_field_when_uneven() -> None:
    x, y = torch.zeros(6, 3), torch.zeros(6)
    assert len(split_batch(x, y, 3, "microbatches")) == 3
    with pytest.raises(ValueError, match="microbatches=4"):
        split_batch(x, y, 4, "microbatches")


def test_models_are_the_composition_of_their_blocks() -> None:
    gpt = GPT(GPTConfig(vocab=16, width=8, depth=2, heads=2, seq_len=4))
    tokens = torch.randint(0, 16, (2, 4))
    x = tokens
    for block in blocks_in_order(gpt):
        x = block(x)
    assert torch.equal(x, gpt(tokens)) and x.shape == (2, 4, 16)
    mlp = MLP(MLPConfig(inputs=5, hidden=7, classes=3, depth=3))
    assert len(blocks_in_order(mlp)) == 3 and mlp(torch.zeros(4, 5)).shape == (4, 3)
    with pytest.raises(TypeError, match="blocks_in_order"):
        blocks_in_order(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"GPTConfig\.width"):
        GPTConfig(width=10, heads=3)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"strategy": "zero"}, "strategy"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"schedule": "interleaved"}, "schedule"),
        ({"collective": "tree"}, "collective"),
        ({"precision": "fp16"}, "precision"),
        ({"microbatches": 0}, "microbatches"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"ddp_bucket_mb": 0}, "ddp_bucket_mb"),
        ({"strategy": "fsdp", "grad_compression": "bf16"}, "grad_compression"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"ParallelConfig\.{field}"):
        ParallelConfig(**kwargs)  # type: ignore[arg-type]


def test_comm_rejects_unknown_algorithm_and_parallelize_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match="collective must be one of"):
        Comm("tree")
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallelize(nn.Linear(2, 2), ParallelConfig(), lambda p: torch.optim.SGD(p, lr=0.1))


def test_a_parameter_shared_across_groups_is_found_by_name_and_groups() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
    blocks = list(model)
    assert parameter_shared_across(model, [[b] for b in blocks]) is None
    model[2].weight = model[0].weight  # tied: blocks 0 and 2
    assert parameter_shared_across(model, [[b] for b in blocks]) == ("0.weight", 0, 2)
    # Within one group (a pipeline stage holding both blocks) it is no problem.
    assert parameter_shared_across(model, [blocks[:3], blocks[3:]]) is None
    assert parameter_shared_across(model, [blocks[:2], blocks[2:]]) == ("0.weight", 0, 1)
    model[0].weight.requires_grad_(False)  # frozen: never sharded or updated, so sharing is harmless
    assert parameter_shared_across(model, [[b] for b in blocks]) is None
