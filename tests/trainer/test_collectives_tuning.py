"""Auto's trials (tuning.py) as plain bookkeeping: who is timed, in which order, who is kept."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dtjob.trainer.collectives.selection import ALGORITHMS, CostModel, choose, predict
from dtjob.trainer.collectives.tuning import (
    BANDWIDTH_FACTOR,
    BLOCK_CALLS,
    FINALISTS,
    MAX_BLOCKS,
    MIN_BLOCKS,
    TIMED_PER_BLOCK,
    TRIAL_FACTOR,
    TRIAL_SECONDS,
    TRIALS_ENV_VAR,
    Trials,
    blocks_per_candidate,
    call_kind,
    candidates,
    plan,
    trials_from_env,
)

MODEL = CostModel(alpha=50e-6, beta=0.4e-9, gamma={"float32": 0.25e-9}, overhead=20e-6)
BYTES_ONLY = replace(MODEL, alpha=0.0, overhead=0.0)  # what MODEL charges for the bytes alone
KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("op", sorted(ALGORITHMS))
@pytest.mark.parametrize("nbytes", [4 * KiB, 1 * MiB, 64 * MiB])
def test_candidates_start_with_the_models_choice_and_keep_only_close_ones(op: str, nbytes: int) -> None:
    found = candidates(op, nbytes, 4, "float32", MODEL)
    assert found[0] == choose(op, nbytes, 4, "float32", MODEL)
    assert "hier" not in found, "hier needs the group's pods"
    best = predict(op, found[0], nbytes, 4, "float32", MODEL)
    for algorithm in (a for a in ALGORITHMS[op] if a not in ("hier", "native")):
        close = predict(op, algorithm, nbytes, 4, "float32", MODEL) <= TRIAL_FACTOR * best
        light = predict(op, algorithm, nbytes, 4, "float32", BYTES_ONLY) <= BANDWIDTH_FACTOR * best
        assert (algorithm in found) == (close and light), (algorithm, found)


@pytest.mark.parametrize("op", sorted(ALGORITHMS))
@pytest.mark.parametrize("nbytes", [4 * KiB, 64 * MiB])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_native_is_always_a_candidate_where_it_is_available(op: str, nbytes: int, world_size: int) -> None:
    # Even where the model prices it far off: it cannot price NCCL's kernels at all.
    far = replace(MODEL, alpha=1e-9)  # latency almost free: rd and tree look best for small calls
    for model in (MODEL, far):
        assert "native" in candidates(op, nbytes, world_size, "float32", model)
    without = tuple(a for a in ALGORITHMS[op] if a not in ("native", "hier"))
    assert "native" not in candidates(op, nbytes, world_size, "float32", MODEL, available=without)


def test_hier_is_timed_where_the_group_spans_pods() -> None:
    found = candidates("allreduce", 1 * MiB, 4, "float32", MODEL, pods=(2, 2))
    assert "hier" in found
    with_available = candidates("allreduce", 1 * MiB, 4, "float32", MODEL, available=("ring", "native"))
    assert set(with_available) <= {"ring", "native"}


def test_rd_is_not_timed_where_its_bytes_alone_outweigh_the_best() -> None:
    # rd moves the whole vector log2(n) times, the others (n-1)/n of it twice: with latency out of
    # the way (64 MiB) it cannot win; where latency decides (4 KiB) it is the model's first choice.
    large = candidates("allreduce", 64 * MiB, 4, "float32", MODEL)
    assert "rd" not in large and {"ring", "hd", "direct"} <= set(large)
    assert candidates("allreduce", 4 * KiB, 4, "float32", MODEL)[0] == "rd"
    best = predict("allreduce", large[0], 64 * MiB, 4, "float32", MODEL)
    assert predict("allreduce", "rd", 64 * MiB, 4, "float32", BYTES_ONLY) > BANDWIDTH_FACTOR * best


def test_the_ring_is_timed_for_a_tiny_all_reduce_on_4_ranks_but_not_on_8() -> None:
    # 6 dependent ring steps against rd's 2: three times the predicted latency, yet in a stream of
    # calls the ring measured fastest (tuning.TRIAL_FACTOR). On 8 ranks, 14 steps against 3.
    assert {"rd", "ring"} <= set(candidates("allreduce", 4 * KiB, 4, "float32", MODEL))
    assert "ring" not in candidates("allreduce", 4 * KiB, 8, "float32", MODEL)


def test_blocks_fit_the_time_budget_within_bounds() -> None:
    assert blocks_per_candidate(0.0, None) == MAX_BLOCKS
    assert blocks_per_candidate(TRIAL_SECONDS / BLOCK_CALLS / 5.1, None) == 5
    assert blocks_per_candidate(10.0, None) == MIN_BLOCKS
    # An explicit number of timed calls is rounded up to whole blocks, past the bounds too.
    assert blocks_per_candidate(10.0, 1) == 1
    assert blocks_per_candidate(0.0, 2 * TIMED_PER_BLOCK + 1) == 3
    assert blocks_per_candidate(0.0, 100) == -(-100 // TIMED_PER_BLOCK)


def test_small_kinds_get_more_blocks_than_large_ones() -> None:
    small = plan("allreduce", 4 * KiB, 4, "float32", MODEL, None)
    large = plan("allreduce", 64 * MiB, 4, "float32", MODEL, None)
    assert small.candidates == candidates("allreduce", 4 * KiB, 4, "float32", MODEL)
    assert (small.blocks, large.blocks) == (MAX_BLOCKS, MIN_BLOCKS)
    assert plan("allreduce", 64 * MiB, 4, "float32", MODEL, 8).blocks == 2


def test_sizes_within_one_power_of_two_share_a_kind() -> None:
    assert call_kind("allreduce", 1025, "float32") == call_kind("allreduce", 2047, "float32")
    assert call_kind("allreduce", 1024, "float32", "cpu") != call_kind("allreduce", 1024, "float32", "cuda")
    assert call_kind("allreduce", 1024, "float32") != call_kind("allreduce", 2048, "float32")
    assert call_kind("allreduce", 1024, "float32") != call_kind("allreduce", 1024, "bfloat16")
    assert call_kind("allreduce", 1024, "float32") != call_kind("allgather", 1024, "float32")


def _run_round(trials: Trials, seconds: dict[str, list[float]], ran: list[str]) -> None:
    """Make the round's calls as api.py does, each candidate's calls timed from its own list."""
    while not trials.ready_to_agree():
        algorithm = trials.next_candidate()
        ran.append(algorithm)
        trials.record(algorithm, seconds[algorithm][ran.count(algorithm) - 1])


def test_candidates_take_turns_in_blocks_then_the_least_median_of_the_ranks_sums_is_kept() -> None:
    assert BLOCK_CALLS == 5 and TIMED_PER_BLOCK == 4
    trials = Trials(("direct", "hd"), blocks=2)  # two candidates: no race, one round
    # Per candidate, its calls in order: each block's settling call (99: never counted), then
    # four timed ones.
    seconds = {
        "direct": [99, 2.0, 2.5, 2.2, 2.1, 99, 2.3, 2.4, 2.0, 2.2],
        "hd": [99, 1.0, 30.0, 0.5, 1.1, 99, 0.9, 1.2, 0.8, 1.0],
    }
    ran: list[str] = []
    _run_round(trials, seconds, ran)
    assert ran == (["direct"] * 5 + ["hd"] * 5) * 2
    assert trials.winner is None
    assert trials.local_seconds() == [s for a in ("direct", "hd") for s in seconds[a] if s != 99]
    # The ranks' sums decide, not this rank's own times (by which hd, median 1.0, would win).
    combined = [1.5] * 5 + [9.0] * 3 + [2.0] * 8  # medians: direct 1.5, hd 2.0
    assert trials.agree(combined) == "direct"
    assert trials.winner == "direct" and not trials.ready_to_agree()


def test_a_race_times_all_for_half_the_blocks_then_only_the_finalists() -> None:
    assert FINALISTS == 2
    trials = Trials(("rd", "direct", "hd", "ring"), blocks=3)  # 2 blocks each, then 1 for two
    seconds = {a: [float(i) for i in range(15)] for a in trials.candidates}
    ran: list[str] = []
    _run_round(trials, seconds, ran)
    assert ran == (["rd"] * 5 + ["direct"] * 5 + ["hd"] * 5 + ["ring"] * 5) * 2
    k = 2 * TIMED_PER_BLOCK
    assert len(trials.local_seconds()) == 4 * k
    # Medians of the ranks' sums: rd 3, direct 2, hd 4, ring 1. The two least go on, in the
    # model's order, and the call that agreed on them goes on with the first finalist's block.
    assert trials.agree([3.0] * k + [2.0] * k + [4.0] * k + [1.0] * k) is None
    assert trials.winner is None and trials.running == ("direct", "ring")
    assert trials.next_candidate() == "direct"
    before = len(ran)
    _run_round(trials, seconds, ran)
    assert ran[before:] == ["direct"] * 5 + ["ring"] * 5
    # The final agreement sees every timed call of both finalists, from both rounds.
    assert trials.local_seconds() == [s for a in ("direct", "ring") for s in trials.seconds[a]]
    assert len(trials.local_seconds()) == 2 * 3 * TIMED_PER_BLOCK
    k = 3 * TIMED_PER_BLOCK
    assert trials.agree([2.0] * k + [1.5] * k) == "ring"
    assert trials.winner == "ring" and not trials.ready_to_agree()


@pytest.mark.parametrize(("found", "blocks"), [(("rd", "hd"), 4), (("rd", "hd", "ring"), 1)])
def test_no_race_with_two_candidates_or_one_block(found: tuple[str, ...], blocks: int) -> None:
    trials = Trials(found, blocks=blocks)
    ran: list[str] = []
    _run_round(trials, {a: [1.0] * 5 * blocks for a in found}, ran)
    assert ran == [a for a in found for _ in range(BLOCK_CALLS)] * blocks
    k = blocks * TIMED_PER_BLOCK
    assert trials.agree([2.0] * k + [1.0] * k + [3.0] * k * (len(found) - 2)) == found[1]


def test_times_recorded_later_count_like_those_recorded_at_once() -> None:
    # A CUDA call's time is a callable, read when the ranks agree; take() counts at the call.
    trials = Trials(("ring", "native"), blocks=1)
    pending: list[str] = []
    while not trials.ready_to_agree():
        algorithm, timed = trials.take()
        pending.append(algorithm)
        if timed:
            trials.add(algorithm, (lambda v: lambda: v)(3.0 if algorithm == "ring" else 2.0))
    assert pending == ["ring"] * 5 + ["native"] * 5
    assert trials.local_seconds() == [3.0] * TIMED_PER_BLOCK + [2.0] * TIMED_PER_BLOCK
    assert trials.agree(trials.local_seconds()) == "native"


def test_ties_go_to_the_models_order() -> None:
    trials = Trials(("rd", "direct"), blocks=1)
    assert trials.agree([2.0] * (2 * TIMED_PER_BLOCK)) == "rd"


@pytest.mark.parametrize("blocks", [0, 4])
def test_nothing_is_timed_without_a_choice_to_make(blocks: int) -> None:
    only = Trials(("direct",), blocks=blocks)
    assert only.winner == "direct" and not only.ready_to_agree()
    if blocks == 0:
        assert Trials(("rd", "hd"), blocks=0).winner == "rd"


def test_trials_setting_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRIALS_ENV_VAR, raising=False)
    assert trials_from_env() is None  # the time budget decides
    monkeypatch.setenv(TRIALS_ENV_VAR, "0")
    assert trials_from_env() == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv(TRIALS_ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{TRIALS_ENV_VAR}={bad!r}.*0 turns trials off"):
            trials_from_env()
