"""The chaos suite's counting (tests/chaos/report.py): percentiles and the per-kind table."""

from __future__ import annotations

from tests.chaos.report import Outcome, markdown, percentile, summarize


def test_nearest_rank_percentiles_of_small_samples() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0
    assert percentile([float(v) for v in range(1, 21)], 95) == 19.0


def test_table_counts_each_kind_and_skips_undetected_times() -> None:
    outcomes = [
        Outcome("sigkill", "a", 1.0, 6.0, 3, 10, exited=0.5, exit_code=137),
        Outcome("sigkill", "b", 2.0, 8.0, 1, 15, exited=0.7, exit_code=137),
        Outcome("ckpt-bitflip", "a", None, 9.0, 7, 5, damaged_step=10),
    ]
    table = summarize(outcomes)
    assert list(table) == ["sigkill", "ckpt-bitflip"]
    assert table["sigkill"]["injected"] == 2
    assert (table["sigkill"]["detected_p50_s"], table["sigkill"]["detected_p95_s"]) == (1.0, 2.0)
    assert (table["sigkill"]["steps_lost_total"], table["sigkill"]["steps_lost_max"]) == (4, 3)
    assert table["ckpt-bitflip"]["detected_p50_s"] is None
    text = markdown(table)
    assert "| sigkill | 2 | 0.5 / 0.7 | 1.0 / 2.0 | 6.0 / 8.0 | 4, 3 |" in text
    assert "| ckpt-bitflip | 1 | - / - | - / - | 9.0 / 9.0 | 7, 7 |" in text
