"""dtjob's collectives as a drop-in for torch.distributed's, in real multi-process gloo groups.

See collectives_dropin.py for what every rank does; each test compares with torch's own results.
"""

from __future__ import annotations

import pytest

from tests.trainer.collectives_harness import run_world
from tests.trainer.test_collectives import _assert_clean, _assert_same_bits_everywhere


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_bool_integer_complex_and_product_reductions_and_any_dtype_copies_match_torch(
    world_size: int,
) -> None:
    results = run_world(world_size, "dropin:dtypes_and_ops")
    _assert_clean(results)
    _assert_same_bits_everywhere(results)


@pytest.mark.slow
def test_the_same_dtypes_on_the_code_path_nccl_takes() -> None:
    results = run_world(3, "dropin:dtypes_and_ops", {"coalescing": True})
    _assert_clean(results)
    _assert_same_bits_everywhere(results)


def test_misuse_raises_what_torch_raises_and_sparse_tensors_are_refused() -> None:
    _assert_clean(run_world(2, "dropin:errors_like_torch"))


def test_work_handles_give_torch_futures_of_the_outputs() -> None:
    _assert_clean(run_world(3, "dropin:futures"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_with_a_communication_hook_on_dtjob_collectives_trains_like_torch(world_size: int) -> None:
    results = run_world(world_size, "dropin:ddp_hook")
    _assert_clean(results)
    _assert_same_bits_everywhere(results)


@pytest.mark.slow
def test_auto_counts_native_among_its_candidates_for_every_op_and_size() -> None:
    results = run_world(4, "dropin:native_everywhere")
    _assert_clean(results)
    candidates = results[0]["candidates"]
    assert all(r["candidates"] == candidates for r in results)
    assert len(candidates) == 8, candidates
    missing = [kind for kind, names in candidates.items() if "native" not in names]
    assert not missing, f"native is not a candidate for {missing}: {candidates}"


def test_a_destroyed_groups_runner_and_thread_go_with_it() -> None:
    _assert_clean(run_world(2, "dropin:destroyed_groups"))
