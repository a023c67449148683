"""Auto's trials (tuning.py) as plain bookkeeping: who is timed, in which order, who is kept."""

from __future__ import annotations

import pytest

from dtjob.trainer.collectives.selection import ALGORITHMS, CostModel, choose, predict
from dtjob.trainer.collectives.tuning import (
    BLOCK_CALLS,
    DEFAULT_TRIALS,
    TRIAL_FACTOR,
    TRIALS_ENV_VAR,
    Trials,
    call_kind,
    candidates,
    trials_from_env,
)

MODEL = CostModel(alpha=50e-6, beta=0.4e-9, gamma={"float32": 0.25e-9}, overhead=20e-6)
KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("op", sorted(ALGORITHMS))
@pytest.mark.parametrize("nbytes", [4 * KiB, 1 * MiB, 64 * MiB])
def test_candidates_start_with_the_models_choice_and_keep_only_close_ones(op: str, nbytes: int) -> None:
    found = candidates(op, nbytes, 4, "float32", MODEL)
    assert found[0] == choose(op, nbytes, 4, "float32", MODEL)
    best = predict(op, found[0], nbytes, 4, "float32", MODEL)
    for algorithm in ALGORITHMS[op]:
        close = predict(op, algorithm, nbytes, 4, "float32", MODEL) <= TRIAL_FACTOR * best
        assert (algorithm in found) == close, (algorithm, found)


def test_a_tiny_all_reduce_does_not_time_the_ring() -> None:
    # 6 dependent ring steps against rd's 2: three times the predicted latency.
    found = candidates("allreduce", 4 * KiB, 4, "float32", MODEL)
    assert "rd" in found and "ring" not in found


def test_sizes_within_one_power_of_two_share_a_kind() -> None:
    assert call_kind("allreduce", 1025, "float32") == call_kind("allreduce", 2047, "float32")
    assert call_kind("allreduce", 1024, "float32") != call_kind("allreduce", 2048, "float32")
    assert call_kind("allreduce", 1024, "float32") != call_kind("allreduce", 1024, "bfloat16")
    assert call_kind("allreduce", 1024, "float32") != call_kind("allgather", 1024, "float32")


def test_candidates_take_turns_in_blocks_then_the_least_median_of_the_ranks_sums_is_kept() -> None:
    assert BLOCK_CALLS == 2
    trials = Trials(("rd", "direct", "hd"), per_candidate=3)
    # Per candidate, its calls in order: a settling call (99: never counted), then a timed one.
    seconds = {
        "rd": [99, 3.0, 99, 9.0, 99, 4.0],
        "direct": [99, 2.0, 99, 2.5, 99, 2.2],
        "hd": [99, 1.0, 99, 30.0, 99, 0.5],
    }
    ran: list[str] = []
    while not trials.ready_to_agree():
        algorithm = trials.next_candidate()
        ran.append(algorithm)
        trials.record(algorithm, seconds[algorithm][ran.count(algorithm) - 1])
    assert ran == ["rd", "rd", "direct", "direct", "hd", "hd"] * 3
    assert trials.winner is None
    assert trials.local_seconds() == [3.0, 9.0, 4.0, 2.0, 2.5, 2.2, 1.0, 30.0, 0.5]
    # The ranks' sums decide, not this rank's own times (by which hd, median 1.0, would win).
    combined = [3.0, 3.0, 3.0, 1.0, 9.0, 1.5, 2.0, 2.0, 2.0]  # medians: rd 3.0, direct 1.5, hd 2.0
    assert trials.agree(combined) == "direct"
    assert trials.winner == "direct" and not trials.ready_to_agree()


def test_ties_go_to_the_models_order() -> None:
    trials = Trials(("rd", "direct"), per_candidate=1)
    assert trials.agree([2.0, 2.0]) == "rd"


@pytest.mark.parametrize("per_candidate", [0, 4])
def test_nothing_is_timed_without_a_choice_to_make(per_candidate: int) -> None:
    only = Trials(("direct",), per_candidate=per_candidate)
    assert only.winner == "direct" and not only.ready_to_agree()
    if per_candidate == 0:
        assert Trials(("rd", "hd"), per_candidate=0).winner == "rd"


def test_trials_setting_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRIALS_ENV_VAR, raising=False)
    assert trials_from_env() == DEFAULT_TRIALS == 9
    monkeypatch.setenv(TRIALS_ENV_VAR, "0")
    assert trials_from_env() == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv(TRIALS_ENV_VAR, bad)
        with pytest.raises(ValueError, match=f"{TRIALS_ENV_VAR}={bad!r}.*0 turns trials off"):
            trials_from_env()
