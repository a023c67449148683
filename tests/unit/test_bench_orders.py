"""The benchmark's timing orders (bench/collectives.py): balanced for what ran just before."""

from __future__ import annotations

import importlib.util
import itertools
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "collectives.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_collectives", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6])
def test_every_item_follows_every_other_equally_often_and_leads_equally_often(count: int) -> None:
    items = tuple(f"impl{i}" for i in range(count))
    orders = _bench().balanced_orders(items)
    assert len(orders) == (2 * count if count % 2 else count)
    assert all(sorted(order) == sorted(items) for order in orders)
    leaders = Counter(order[0] for order in orders)
    assert set(leaders.values()) == {len(orders) // count}
    follows = Counter((a, b) for order in orders for a, b in itertools.pairwise(order))
    pairs = [(a, b) for a in items for b in items if a != b]
    assert sorted(follows) == sorted(pairs)
    assert len(set(follows.values())) <= 1  # every ordered pair equally often


def test_the_benchs_five_implementations_take_ten_orders() -> None:
    bench = _bench()
    orders = bench.balanced_orders(bench.IMPLS)
    assert len(orders) == 10
    assert orders[0] == ["native", "ring", "auto", "hd", "direct"]
