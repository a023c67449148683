"""Pure parts of the collectives: the cost model's choice, DTJOB_COLLECTIVE_ALGO, chunk layouts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtjob.trainer.collectives import api
from dtjob.trainer.collectives.halving_doubling import Fold
from dtjob.trainer.collectives.peers import balanced_bounds
from dtjob.trainer.collectives.reduce_ops import Reduction
from dtjob.trainer.collectives.selection import ALGORITHMS, CostModel, choose, parse_override, predict

# A loopback-like group: 50 us per exchange, 2.5 GB/s per link, 4 GB/s float32 adds, 20 us per
# further message posted in the same step.
MODEL = CostModel(alpha=50e-6, beta=0.4e-9, gamma={"float32": 0.25e-9, "bfloat16": 1e-9}, overhead=20e-6)
# The same links where a message posted alongside others costs 4x a whole exchange.
COSTLY_MESSAGES = CostModel(alpha=50e-6, beta=0.4e-9, gamma={"float32": 0.25e-9}, overhead=200e-6)
KiB, MiB = 1 << 10, 1 << 20


def test_tiny_all_reduce_takes_the_fewest_rounds() -> None:
    # 4 KiB: latency dominates, so log2(p) full swaps beat 2(p-1) ring steps and 2 log2(p) HD steps.
    assert choose("allreduce", 4 * KiB, 4, "float32", MODEL) == "rd"
    assert choose("allreduce", 4 * KiB, 8, "float32", MODEL) == "rd"


def test_large_all_reduce_on_odd_world_sizes_avoids_the_fold() -> None:
    # HD's fold moves the whole vector twice more when n is not a power of two; direct and ring
    # move the same bytes, and direct saves the ring's dependent steps while messages are cheap.
    for n in (3, 6):
        assert choose("allreduce", 64 * MiB, n, "float32", MODEL) == "direct"
        assert choose("allreduce", 64 * MiB, n, "float32", COSTLY_MESSAGES) == "ring"


def test_direct_wins_from_mid_sizes_when_extra_messages_are_cheaper_than_steps() -> None:
    # 4 ranks: 2 phases + 4 further messages instead of the ring's 6 steps or HD's 4.
    assert choose("allreduce", 4 * MiB, 4, "float32", MODEL) == "direct"
    assert choose("reduce_scatter", 4 * MiB, 4, "float32", MODEL) == "direct"
    assert choose("allgather", 4 * MiB, 4, "float32", MODEL) == "direct"
    assert choose("allreduce", 4 * MiB, 4, "float32", COSTLY_MESSAGES) in ("ring", "hd")


def test_large_all_reduce_on_powers_of_two_avoids_recursive_doubling() -> None:
    assert choose("allreduce", 64 * MiB, 8, "float32", MODEL) == "direct"
    assert choose("allreduce", 64 * MiB, 8, "float32", COSTLY_MESSAGES) in ("ring", "hd")


def test_bandwidth_heavy_model_moves_the_crossover_up() -> None:
    slow_links = CostModel(alpha=5e-6, beta=5e-9, gamma={"float32": 0.25e-9}, overhead=2e-6)
    # Latency is cheap here, so bandwidth-optimal algorithms win earlier than with MODEL.
    sizes = [2**k for k in range(10, 27)]

    def first_bandwidth_optimal(model: CostModel) -> int:
        return next(s for s in sizes if choose("allreduce", s, 6, "float32", model) in ("ring", "direct"))

    assert first_bandwidth_optimal(slow_links) < first_bandwidth_optimal(MODEL)


def test_broadcast_uses_the_tree_for_small_and_scatter_allgather_for_large() -> None:
    assert choose("broadcast", 1 * KiB, 8, "float32", MODEL) == "tree"
    assert choose("broadcast", 64 * MiB, 8, "float32", MODEL) in ("ring", "hd")


def test_every_offered_algorithm_has_an_implementation_and_a_cost() -> None:
    tables = {
        "allreduce": api._ALL_REDUCE,
        "reduce_scatter": api._REDUCE_SCATTER,
        "allgather": api._ALL_GATHER,
        "broadcast": api._BROADCAST,
    }
    own = {op: set(a) - {"native", "hier"} for op, a in ALGORITHMS.items()}
    assert {op: set(t) for op, t in tables.items()} == own
    assert all("native" in algos for algos in ALGORITHMS.values()), "native is offered for every op"
    assert [op for op, algos in ALGORITHMS.items() if "hier" in algos] == ["allreduce"]
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            assert predict(op, algo, 1 * MiB, 4, "float32", MODEL, pods=(2, 2)) > 0


def test_predictions_are_zero_for_one_rank_or_no_bytes_and_grow_with_size() -> None:
    for op, algos in ALGORITHMS.items():
        for algo in algos:
            assert predict(op, algo, 1 * MiB, 1, "float32", MODEL) == 0.0
            assert predict(op, algo, 0, 4, "float32", MODEL) == 0.0
            assert predict(op, algo, 1 * MiB, 6, "float32", MODEL, pods=(3, 2)) < predict(
                op, algo, 8 * MiB, 6, "float32", MODEL, pods=(3, 2)
            )


def test_hier_moves_the_rings_bytes_in_fewer_steps_and_needs_the_pods() -> None:
    # 2 pods x 2: 2 steps inside, 2 across against the ring's 6; the bytes are the ring's.
    bytes_only = CostModel(alpha=0.0, beta=MODEL.beta, gamma={"float32": 0.0})
    for pods in ((2, 2), (2, 3), (3, 2)):
        n = pods[0] * pods[1]
        ring = predict("allreduce", "ring", 64 * MiB, n, "float32", bytes_only)
        hier = predict("allreduce", "hier", 64 * MiB, n, "float32", bytes_only, pods=pods)
        assert hier == pytest.approx(ring)
    latency_only = CostModel(alpha=1.0, beta=0.0, gamma={"float32": 0.0})
    assert predict("allreduce", "hier", 4 * KiB, 4, "float32", latency_only, pods=(2, 2)) == 4
    assert predict("allreduce", "ring", 4 * KiB, 4, "float32", latency_only) == 6
    with pytest.raises(ValueError, match="pods"):
        predict("allreduce", "hier", 4 * KiB, 4, "float32", MODEL)
    assert choose("allreduce", 4 * KiB, 4, "float32", MODEL) != "hier"  # not offered without pods


def test_native_is_priced_as_torchs_gloo_runs_it() -> None:
    for size in (4 * KiB, 64 * MiB):
        ring_all_reduce = predict("allreduce", "ring", size, 4, "float32", MODEL)
        assert predict("allreduce", "native", size, 4, "float32", MODEL) == ring_all_reduce
        # gloo's reduce-scatter is a whole all-reduce and a copy
        assert predict("reduce_scatter", "native", size, 4, "float32", MODEL) == ring_all_reduce
    # Ties go to dtjob's own: native comes last in ALGORITHMS.
    assert choose("allreduce", 64 * MiB, 4, "float32", COSTLY_MESSAGES) != "native"
    assert choose("allgather", 64 * MiB, 4, "float32", MODEL, available=("native", "hd")) in ("native", "hd")


def test_slower_reduction_dtype_costs_more() -> None:
    assert predict("allreduce", "ring", 8 * MiB, 4, "bfloat16", MODEL) > predict(
        "allreduce", "ring", 8 * MiB, 4, "float32", MODEL
    )


def test_override_parsing() -> None:
    assert parse_override("allreduce:hd;reduce_scatter:ring") == {"allreduce": "hd", "reduce_scatter": "ring"}
    assert parse_override(" all_reduce : RD ; ") == {"allreduce": "rd"}
    assert parse_override("ring") == {op: "ring" for op in ALGORITHMS}
    assert parse_override("tree") == {"broadcast": "tree"}
    assert parse_override("allgather:auto") == {}
    assert parse_override("") == {}
    assert parse_override("all_gather_into_tensor:hd,broadcast:ring") == {
        "allgather": "hd",
        "broadcast": "ring",
    }


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("allreduce:tree", "allreduce has no algorithm 'tree'"),
        ("alltoall:ring", "unknown collective 'alltoall'"),
        ("bogus", "unknown algorithm 'bogus'"),
    ],
)
def test_override_errors_name_the_variable_and_the_choices(text: str, words: str) -> None:
    with pytest.raises(ValueError, match="DTJOB_COLLECTIVE_ALGO") as raised:
        parse_override(text)
    assert words in str(raised.value)


def test_balanced_bounds_cover_everything_with_sizes_differing_by_at_most_one() -> None:
    for numel in (0, 1, 3, 7, 8, 100_003):
        for parts in (1, 3, 4, 8):
            b = balanced_bounds(numel, parts)
            sizes = [b[i + 1] - b[i] for i in range(parts)]
            assert b[0] == 0 and b[-1] == numel and len(b) == parts + 1
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 8])
def test_fold_maps_every_rank_to_one_power_of_two_block(n: int) -> None:
    fold = Fold(n)
    assert fold.p & (fold.p - 1) == 0 and fold.p <= n < 2 * fold.p
    virtual = [fold.virtual(r) for r in range(n)]
    active = [v for v in virtual if v is not None]
    assert sorted(active) == list(range(fold.p))
    assert all(fold.virtual(fold.real(v)) == v for v in range(fold.p))
    # Blocks are the contiguous union of their real ranks' chunks.
    bounds = list(range(0, 10 * (n + 1), 10))
    vb = fold.block_bounds(bounds)
    assert vb[0] == 0 and vb[-1] == bounds[-1] and vb == sorted(vb)


def test_integer_average_truncates_toward_zero_as_nccl_does() -> None:
    avg = Reduction(dist.ReduceOp.AVG, torch.int64)
    chunk = torch.tensor([7, -7, 6, -1])
    avg.finish(chunk, 3)
    assert chunk.tolist() == [2, -2, 2, 0]
    floats = Reduction(dist.ReduceOp.AVG, torch.float32)
    chunk = torch.tensor([3.0, 6.0])
    floats.finish(chunk, 3)
    assert chunk.tolist() == [1.0, 2.0]
    unfinished = floats.without_finish()
    unfinished.finish(chunk, 3)
    assert chunk.tolist() == [1.0, 2.0] and floats.is_average and not unfinished.is_average


@pytest.mark.parametrize(
    ("op", "dtype", "error", "words"),
    [
        (dist.ReduceOp.AVG, torch.bool, TypeError, "boolean"),
        (dist.ReduceOp.MAX, torch.complex64, ValueError, "complex"),
        (dist.ReduceOp.BAND, torch.float32, ValueError, "non-integral"),
        (dist.ReduceOp.SUM, torch.uint32, TypeError, "uint32"),
        (dist.ReduceOp.SUM, torch.float8_e4m3fn, TypeError, "float8"),
    ],
)
def test_reductions_nobody_defines_raise_torchs_classes_and_runtime_error(
    op: dist.ReduceOp.RedOpType, dtype: torch.dtype, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words) as raised:
        Reduction(op, dtype)
    assert isinstance(raised.value, RuntimeError), "gloo raises RuntimeError for these"


def test_bool_and_complex_reduce_like_torchs_backends() -> None:
    a, b = torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])
    for op, want in (
        (dist.ReduceOp.SUM, [True, True, True, False]),
        (dist.ReduceOp.PRODUCT, [True, False, False, False]),
        (dist.ReduceOp.MIN, [True, False, False, False]),
        (dist.ReduceOp.BXOR, [False, True, True, False]),
    ):
        acc = a.clone()
        Reduction(op, torch.bool).combine(acc, b)
        assert acc.tolist() == want, op
    total = Reduction(dist.ReduceOp.AVG, torch.complex64)
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    view = total.view(x)
    assert view.dtype == torch.float32 and view.numel() == 4
    total.combine(view, view.clone())
    total.finish(view, 2)
    assert x.tolist() == [1 + 2j, 3 - 4j]
