"""Pure pieces of the wrappers: schedules, stage split and ownership, buckets, unit choice, and
the errors of misuse (in a one-process gloo group where a process group is needed)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dtjob.trainer.models import GPT, MLP, GPTConfig, MLPConfig
from dtjob.trainer.parallel import data_parallel, fully_shard, pipeline
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.common import blocks_in_order, repeated_blocks
from dtjob.trainer.parallel.ddp import assign_buckets
from dtjob.trainer.parallel.ddp.buckets import MiB
from dtjob.trainer.parallel.fsdp import auto_units
from dtjob.trainer.parallel.pp import Action, auto_split, schedule_actions, split_stages
from dtjob.trainer.parallel.pp.split import plan
from dtjob.trainer.parallel.shards import split_range


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
    with pytest.raises(ValueError, match="first_bucket_mb"):
        assign_buckets(params, 0, MiB)
    mixed = [nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert len(assign_buckets(mixed, MiB, MiB)) == 2  # one dtype per bucket


def test_split_range_covers_every_element_once() -> None:
    for numel in (0, 1, 5, 12, 13):
        for size in (1, 2, 3, 4):
            ranges = [split_range(numel, r, size) for r in range(size)]
            covered = [i for lo, hi in ranges for i in range(lo, hi)]
            assert covered == list(range(numel))


def test_models_are_the_composition_of_their_blocks() -> None:
    gpt = GPT(GPTConfig(vocab=16, width=8, depth=2, heads=2, seq_len=4))
    tokens = torch.randint(0, 16, (2, 4))
    x = tokens
    for block in blocks_in_order(gpt):
        x = block(x)
    assert torch.equal(x, gpt(tokens)) and x.shape == (2, 4, 16)
    mlp = MLP(MLPConfig(inputs=5, hidden=7, classes=3, depth=3))
    assert len(blocks_in_order(mlp) or []) == 3 and mlp(torch.zeros(4, 5)).shape == (4, 3)
    assert blocks_in_order(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match=r"GPTConfig\.width"):
        GPTConfig(width=10, heads=3)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class Tower(nn.Module):
    """Not a sequence of blocks: embedding, a ModuleList of blocks, a head tied to the embedding."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def test_units_are_the_blocks_or_the_repeated_blocks() -> None:
    gpt = GPT(GPTConfig(vocab=16, width=8, depth=2, heads=2, seq_len=4))
    assert auto_units(gpt) == gpt.blocks_in_order()
    tower = Tower()
    assert auto_units(tower) == list(tower.layers)
    tower._no_split_modules = []  # type: ignore[assignment]
    assert repeated_blocks(tower) == list(tower.layers)  # the longest ModuleList of one class
    assert repeated_blocks(nn.Linear(2, 2)) == []


def test_stage_plan_owns_each_parameter_where_its_module_runs_and_a_tied_one_twice() -> None:
    tower = Tower()
    assert auto_split(tower, 2) == ["layers.2"]
    p = plan(tower, ["layers.2"])
    assert p.stage_of_module["layers.1"] == 0 and p.stage_of_module["norm"] == 1
    assert p.owners[id(tower.layers[0].lin.weight)] == {0}
    assert p.owners[id(tower.norm.weight)] == {1}
    assert p.owners[id(tower.embed.weight)] == {0, 1}  # the head on stage 1 shares it
    # Stage 1 stands in for the modules before its boundary that hold parameters.
    assert p.stand_ins[1] == ["embed", "layers.0", "layers.1"]
    # The ModuleList itself is never called: its members stand in, one by one.
    assert plan(tower, ["norm"]).stand_ins[1] == ["embed", "layers.0", "layers.1", "layers.2", "layers.3"]
    with pytest.raises(ValueError, match=r"no submodule 'layers\.9'"):
        plan(tower, ["layers.9"])
    with pytest.raises(ValueError, match="not in the model's module order"):
        plan(tower, ["layers.3", "layers.1"])


@pytest.fixture(scope="module")
def one_process_group() -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def test_wrappers_reject_misuse_with_the_argument_named(one_process_group: None) -> None:
    with pytest.raises(ValueError, match="zero_stage must be 1, 2 or 3"):
        fully_shard(nn.Linear(2, 2), zero_stage=4)
    with pytest.raises(ValueError, match="collective must be one of"):
        data_parallel(nn.Linear(2, 2), collective="tree")
    with pytest.raises(ValueError, match=r"stages=3 must be a positive divisor"):
        pipeline(Tower(), stages=3)
    with pytest.raises(ValueError, match="schedule must be"):
        pipeline(Tower(), stages=1, schedule="interleaved")
    tower = Tower()
    with pytest.raises(ValueError, match="must not nest"):
        fully_shard(tower, units=["layers", "layers.0"])
    with pytest.raises(ValueError, match="no submodule 'blocks'"):
        fully_shard(tower, units=["blocks"])
    wrapped = data_parallel(Tower())
    with pytest.raises(ValueError, match="already wrapped"):
        fully_shard(wrapped)
    with pytest.raises(RuntimeError, match="move the model to its device"):
        wrapped.to(torch.float64)


def test_sharded_module_between_steps_holds_only_shards_and_its_state_dict_works(
    one_process_group: None,
) -> None:
    torch.manual_seed(0)
    plain = Tower()
    model = fully_shard(Tower(), zero_stage=3)
    model.load_state_dict(plain.state_dict())  # full tensors in: each rank keeps its piece
    ids = torch.randint(0, 10, (2, 3))
    with torch.no_grad():
        assert torch.allclose(model(ids), plain(ids))
    model(ids).sum().backward()  # a step opens in forward and closes when backward ends
    state = model.state_dict()  # the shards: each parameter's rows under the original names
    assert set(state) == set(plain.state_dict()) and state["layers.0.lin.weight"].dim() == 2
    assert dict(model.named_parameters()).keys() == dict(plain.named_parameters()).keys()
    with pytest.raises(RuntimeError, match="outside the wrapped model's forward"):
        model.module.layers[0](torch.zeros(1, 4))


def test_optimizers_that_read_whole_parameters_are_refused_on_pieces(one_process_group: None) -> None:
    model = fully_shard(Tower(), zero_stage=2)
    model(torch.randint(0, 10, (2, 3))).sum().backward()
    for make in (torch.optim.Adafactor, torch.optim.LBFGS):
        optimizer = make(model.parameters())
        with pytest.raises(ValueError, match=f"{make.__name__} cannot train a model wrapped by fully_shard"):
            optimizer.step(lambda: torch.zeros(()))
    torch.optim.AdamW(model.parameters()).step()  # elementwise: fine
    torch.optim.Adafactor(Tower().parameters()).step()  # an unwrapped model: none of our business


def test_a_pipeline_stage_state_dict_is_its_own_tensors_under_the_original_names(
    one_process_group: None,
) -> None:
    torch.manual_seed(0)
    plain = Tower()
    pipe = pipeline(Tower(), stages=1)
    pipe.load_state_dict(plain.state_dict())  # a plain model's state dict: the stage takes its part
    state = pipe.state_dict()
    assert set(state) <= set(plain.state_dict()) and "layers.3.lin.weight" in state
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in state.items())
    with pytest.raises(KeyError, match="lacks"):
        pipe.load_state_dict({})


def test_an_fp16_pipeline_needs_a_scaler_whose_skips_every_rank_shares(one_process_group: None) -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    pipe = pipeline(Tower(), stages=1, mixed_precision="fp16", loss_fn=lambda out, _: out.float().mean())
    ids = torch.randint(0, 10, (4, 3))
    with pytest.raises(ValueError, match="needs loss scaling"):
        pipe.step(ids)  # unscaled fp16 gradients underflow
    with pytest.raises(TypeError, match="ShardedGradScaler"):
        pipe.step(ids, scaler=torch.amp.GradScaler("cpu"))  # its overflow finding is this rank's alone
    pipe.step(ids, scaler=ShardedGradScaler("cpu"))


def test_comm_rejects_unknown_algorithm_and_wrappers_need_a_process_group() -> None:
    with pytest.raises(ValueError, match="collective must be one of"):
        Comm("tree")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            data_parallel(nn.Linear(2, 2))
