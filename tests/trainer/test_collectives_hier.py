"""The hierarchical all-reduce against torch, in real multi-process gloo groups laid out in pods.

See collectives_hier.py for what every rank does.
"""

from __future__ import annotations

import pytest

from dtjob.trainer.collectives.hierarchical import PodLayout, pod_layout
from tests.trainer.collectives_harness import run_world
from tests.trainer.test_collectives import _assert_clean, _assert_same_bits_everywhere


@pytest.mark.slow
@pytest.mark.parametrize(("pods", "per_pod"), [(2, 2), (2, 3), (3, 2)])
def test_hier_matches_torch_bitwise_on_every_rank(pods: int, per_pod: int) -> None:
    results = run_world(pods * per_pod, "hier:hierarchical", per_pod)
    _assert_clean(results)
    _assert_same_bits_everywhere(results)


@pytest.mark.slow
def test_auto_times_hier_when_the_group_spans_pods() -> None:
    results = run_world(4, "hier:auto_considers_hier", 2)
    _assert_clean(results)
    _assert_same_bits_everywhere(results)
    assert "hier" in results[0]["candidates"], results[0]["candidates"]
    assert "hier" in results[0]["ran"], "hier was never timed"
    assert all(r["ran"] == results[0]["ran"] for r in results)


def test_pod_layouts() -> None:
    assert pod_layout(range(6), 3) == PodLayout(((0, 1, 2), (3, 4, 5)))
    assert pod_layout(range(6), 2) == PodLayout(((0, 1), (2, 3), (4, 5)))
    # A subgroup: global ranks 0, 1, 3, 4 of pods of 3 are group ranks 0..3, two per pod.
    assert pod_layout([0, 1, 3, 4], 3) == PodLayout(((0, 1), (2, 3)))
    assert "one pod" in str(pod_layout(range(3), 3))
    assert "per pod" in str(pod_layout([0, 1, 2, 3], 3))  # three and one
    assert "per pod" in str(pod_layout([0, 2, 4], 2))  # one member in each pod
    assert "one process per pod" in str(pod_layout(range(4), 1))
    assert PodLayout(((0, 1), (2, 3))).position(3) == (1, 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "per_pod", "hier"), [(4, 2, True), (2, 2, False), (3, 2, False), (2, 1, False)]
)
def test_the_wrappers_hier_uses_auto_where_hier_does_not_apply(world: int, per_pod: int, hier: bool) -> None:
    results = run_world(world, "hier:strategy_comm", per_pod)
    assert all(r["failures"] == [] for r in results), results
    assert all((r["ran"] == "hier") == hier for r in results), [r["ran"] for r in results]
