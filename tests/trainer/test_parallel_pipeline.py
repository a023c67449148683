"""pipeline: GPipe and 1F1B with 2 and 4 stages, and DP x PP (2 x 2), against one process.

Runs in the same process groups as test_parallel_data.py (see _parallel_cases.py).
"""

from __future__ import annotations

import pytest

from tests.trainer import _parallel_cases as pc
from tests.trainer import _parallel_harness as h

pytestmark = pytest.mark.slow


def _pipeline(world: int) -> list[str]:
    return [c["name"] for c in pc.exact_cases(world) if c["name"].startswith("pp")]


@pytest.mark.parametrize(("world", "name"), [(w, n) for w in (2, 4) for n in _pipeline(w)])
def test_matches_single_process(world: int, name: str) -> None:
    h.check_against_reference(pc.results(world), pc.case(world, name))


@pytest.mark.parametrize("world", [2, 4])
def test_live_activations_gpipe_all_microbatches_1f1b_at_most_stages(world: int) -> None:
    """Measured from the bytes autograd saves: peak / one micro-batch's worth."""
    results = pc.results(world)
    for stages in [2] if world == 2 else [4, 2]:
        microbatches = 4
        for rank, result in enumerate(results):
            stage = rank % stages
            gpipe = result[f"pp{stages}-gpipe-native"]["peak_live_microbatches"]
            one_f_one_b = result[f"pp{stages}-1f1b-native"]["peak_live_microbatches"]
            assert gpipe == pytest.approx(microbatches), f"P={stages} rank {rank}: GPipe peak {gpipe}"
            # 1F1B: stage s warms up with P-s-1 forwards, then one more before its first backward.
            assert one_f_one_b == pytest.approx(min(stages - stage, microbatches)), (
                f"P={stages} rank {rank}: 1F1B peak {one_f_one_b}"
            )
            assert one_f_one_b <= stages


def test_resumes_with_more_replicas() -> None:
    """2 stages x 1 replica saved at world 2, resumed as 2 stages x 2 replicas at world 4."""
    h.check_against_reference(pc.results(4), pc.case(4, "resume-pp2-as-2x2"))


def test_extra_state_is_identical_on_every_stage() -> None:
    extras = [r["pp2-1f1b-native"]["extras"][-1] for r in pc.results(4)]
    assert extras[0]["tensor_states"] == ["exp_avg", "exp_avg_sq"]
    assert all(e == extras[0] for e in extras)
