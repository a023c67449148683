"""dtjob's collectives against torch.distributed, in real multi-process gloo groups on localhost.

Each test starts one world (a forked process per rank) and runs a whole scenario inside it; see
collectives_scenarios.py for what every rank does.
"""

from __future__ import annotations

from typing import Any

import pytest

from dtjob.trainer import collectives as C
from dtjob.trainer.collectives.tuning import BLOCK_CALLS, FINALISTS, TIMED_PER_BLOCK
from tests.trainer.collectives_harness import run_world


def _assert_clean(results: list[dict[str, Any]]) -> None:
    failures = [f"rank {rank}: {f}" for rank, r in enumerate(results) for f in r["failures"]]
    assert not failures, "\n".join(failures)
    assert all(r["cases"] > 0 for r in results), "a scenario checked nothing"


def _assert_same_bits_everywhere(results: list[dict[str, Any]], ranks: list[int] | None = None) -> None:
    chosen = [results[r] for r in (ranks if ranks is not None else range(len(results)))]
    keys = chosen[0]["digests"].keys()
    assert keys, "no results were recorded"
    differing = [k for k in keys if len({r["digests"][k] for r in chosen}) != 1]
    assert not differing, f"results differ across ranks for {differing[:10]}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_op_dtype_algorithm_and_length_matches_torch(world_size: int) -> None:
    results = run_world(world_size, "matrix")
    _assert_clean(results)
    _assert_same_bits_everywhere(results)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_the_stream_ordered_posting_nccl_needs_matches_torch_too(world_size: int) -> None:
    results = run_world(world_size, "stream_ordered")
    _assert_clean(results)
    _assert_same_bits_everywhere(results)


@pytest.mark.slow
def test_subgroups_of_six_ranks_run_side_by_side() -> None:
    results = run_world(6, "subgroup")
    _assert_clean(results)
    assert [r["members"] for r in results] == [
        (0, 2, 5),
        (1, 3, 4),
        (0, 2, 5),
        (1, 3, 4),
        (1, 3, 4),
        (0, 2, 5),
    ]
    _assert_same_bits_everywhere(results, [1, 3, 4])
    _assert_same_bits_everywhere(results, [0, 2, 5])


def test_async_calls_in_flight_do_not_interfere() -> None:
    _assert_clean(run_world(3, "concurrent"))


def test_hundreds_of_small_calls_in_a_row() -> None:
    _assert_clean(run_world(4, "many_small", 300))


def test_bad_arguments_raise_clear_errors_and_odd_layouts_work() -> None:
    _assert_clean(run_world(2, "errors_and_layouts"))


def test_reduce_scatter_into_a_view_of_its_own_input() -> None:
    _assert_clean(run_world(4, "aliased_output", 1 << 19))  # 4 MiB chunks of float64


def test_auto_times_its_candidates_in_turn_then_every_rank_keeps_the_same_one() -> None:
    trials = TIMED_PER_BLOCK + 1  # timed calls per candidate: two blocks each
    results = run_world(4, "auto_trials", trials)
    _assert_clean(results)
    _assert_same_bits_everywhere(results)
    assert all(r["ran"] == results[0]["ran"] and r["candidates"] == results[0]["candidates"] for r in results)
    for name, ran in results[0]["ran"].items():
        candidates = results[0]["candidates"][name]
        turns = [c for c in candidates for _ in range(BLOCK_CALLS)]
        if len(candidates) > FINALISTS:  # a race: one block each, then one more for two finalists
            assert ran[: len(turns)] == turns, f"{name}: the candidates must take turns: {ran}"
            final = ran[len(turns) : len(turns) + FINALISTS * BLOCK_CALLS]
            finalists = sorted(set(final), key=candidates.index)
            assert final == [c for c in finalists for _ in range(BLOCK_CALLS)], f"{name}: {ran}"
            after = ran[len(turns) + len(final) :]
        else:
            finalists = candidates
            timed = len(turns) * 2 if len(candidates) > 1 else 0
            assert ran[:timed] == turns * 2, f"{name}: the candidates must take turns: {ran}"
            after = ran[timed:]
        assert len(set(after)) == 1 and after[0] in finalists, f"{name}: no single finalist kept: {ran}"


def test_a_dead_peer_makes_the_call_raise_instead_of_hanging() -> None:
    # A 5 s process-group timeout: ranks that wait on the dead rank's neighbours give up then.
    results = run_world(3, "dead_peer", pg_timeout_s=5.0, timeout_s=120.0)
    assert results[2] is None, "rank 2 was meant to die"
    for rank in (0, 1):
        for call in ("ring", "hd-async"):
            assert results[rank][call].startswith("raised"), f"rank {rank} {call}: {results[rank]}"


def test_trainer_comm_runs_every_choice_and_labels_metrics_with_the_algorithm_that_ran() -> None:
    results = run_world(2, "trainer_comm_metrics")
    for result in results:
        labels = result["labels"]
        assert "auto" not in labels, f"'auto' must be resolved in the metric labels: {labels}"
        assert labels["native"] == ["all_gather", "all_reduce", "broadcast", "reduce_scatter"]
        # "direct" was asked for all four; its broadcast fell back to auto, which chose a tree or
        # scatter algorithm, and the labels say so.
        assert {"all_gather", "reduce_scatter"} <= set(labels["direct"]), labels
        assert labels.pop("p2p") == ["recv", "send"] and result["p2p_bytes_sent"] == 3 * 4
        assert labels.pop("none") == ["all_reduce"], "an empty all-reduce sends nothing, so ran nothing"
        ran = set(labels) - {"native"}
        assert ran <= set(C.ALGORITHMS["allreduce"]) | set(C.ALGORITHMS["broadcast"]), labels
        ops = {op for name, names in labels.items() if name != "native" for op in names}
        assert ops == {"all_gather", "all_reduce", "broadcast", "reduce_scatter"}, labels
    assert results[0] == results[1]
