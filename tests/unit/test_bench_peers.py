"""The peers bench's bookkeeping of steps redone and lost across gangs (bench/peers/scenarios.py)."""

from __future__ import annotations

from typing import Any

from bench.peers.scenarios import steps_accounting


def _log(*entries: tuple[float, int, int]) -> list[tuple[float, dict[str, Any]]]:
    return [(at, {"step": step, "world_size": ws}) for at, step, ws in entries]


def test_a_gang_resumed_from_an_older_checkpoint_redid_the_steps_since() -> None:
    # fault after step 12 at t=10; the new gang resumed at step 11 (checkpoint 10)
    records = _log((9, 11, 2), (9.5, 12, 2), (20, 11, 2), (21, 12, 2), (22, 13, 2))
    assert steps_accounting(records, 10, 30) == {"repeated": 2, "lost": 0}


def test_each_gang_in_the_window_counts_a_peer_that_shrinks_then_grows_back() -> None:
    # on at 1 worker from checkpoint 40 (2 redone), then back at 2 from checkpoint 45 (1 redone)
    records = _log((9, 42, 2), (20, 41, 1), (21, 42, 1), (22, 43, 1), (23, 44, 1), (24, 45, 1),
                   (25, 46, 1), (40, 46, 2), (41, 47, 2))  # fmt: skip
    assert steps_accounting(records, 10, 50) == {"repeated": 3, "lost": 0}


def test_a_rescale_that_checkpoints_where_it_stops_redoes_nothing_and_the_window_ends_at_t1() -> None:
    records = _log((9, 57, 2), (12, 58, 2), (20, 59, 1), (21, 60, 1), (35, 55, 2))
    assert steps_accounting(records, 10, 30) == {"repeated": 0, "lost": 0}


def test_a_gang_that_skips_steps_lost_them() -> None:
    records = _log((9, 12, 2), (20, 16, 2))
    assert steps_accounting(records, 10, 30) == {"repeated": 0, "lost": 3}
