"""The peers bench's bookkeeping of steps redone and lost across gangs (bench/peers/scenarios.py)."""

from __future__ import annotations

from typing import Any

from bench.peers.scenarios import meet, steps_accounting


def _log(*entries: tuple[float, int, int]) -> list[tuple[float, dict[str, Any]]]:
    return [(at, {"step": step, "world_size": ws}) for at, step, ws in entries]


def test_a_gang_resumed_from_an_older_checkpoint_redid_the_steps_since() -> None:
    # fault after step 12 at t=10; the new gang resumed at step 11 (checkpoint 10)
    records = _log((9, 11, 2), (9.5, 12, 2), (20, 11, 2), (21, 12, 2), (22, 13, 2))
    assert steps_accounting(records, 10, 30) == {"repeated": 2, "lost": 0}


def test_each_gang_in_the_window_counts_a_peer_that_shrinks_then_grows_back() -> None:
    # on at 1 worker from checkpoint 40 (2 redone), then back at 2 from checkpoint 45 (1 redone)
    records = _log(
        (9, 42, 2),
        (20, 41, 1),
        (21, 42, 1),
        (22, 43, 1),
        (23, 44, 1),
        (24, 45, 1),
        (25, 46, 1),
        (40, 46, 2),
        (41, 47, 2),
    )
    assert steps_accounting(records, 10, 50) == {"repeated": 3, "lost": 0}


def test_a_rescale_that_checkpoints_where_it_stops_redoes_nothing_and_the_window_ends_at_t1() -> None:
    records = _log((9, 57, 2), (12, 58, 2), (20, 59, 1), (21, 60, 1), (35, 55, 2))
    assert steps_accounting(records, 10, 30) == {"repeated": 0, "lost": 0}


def test_a_gang_that_skips_steps_lost_them() -> None:
    records = _log((9, 12, 2), (20, 16, 2))
    assert steps_accounting(records, 10, 30) == {"repeated": 0, "lost": 3}


def test_a_fault_meets_the_gang_held_at_its_step_or_opens_the_gate_for_one_that_resumed_past_it() -> None:
    at = {"step": 52, "world_size": 2}
    assert meet(at, 52, 2, running=2, limit=60) == ("ready", 52)
    assert meet(at, 52, 2, running=1, limit=60) == ("wait", 0), "a worker not running yet"
    assert meet({"step": 50, "world_size": 2}, 52, 2, running=2, limit=60) == ("wait", 0)
    # The gang of 1 went one step past the gate (SIGTERM there) and checkpointed it; the gang of 2
    # resumed from that checkpoint and waits at the gate without a step to log.
    assert meet({"step": 53, "world_size": 1}, 52, 2, running=2, limit=60) == ("open", 54)
    assert meet({"step": 54, "world_size": 2}, 52, 2, running=2, limit=60) == ("ready", 54)
    late = meet({"step": 59, "world_size": 1}, 52, 2, running=2, limit=60)
    assert late == ("wait", 0), "never past the next fault's step"
    assert meet(None, 12, 2, running=2, limit=27) == ("wait", 0)
