"""The cached message layouts of the ring and of halving-doubling, as plain offsets (no processes).

The multi-process suite checks the results against torch; these pin down the schedule itself: who
sends which segment at which step, so a layout that happens to produce right sums by luck (or only
at the lengths the suite runs) still fails here.
"""

from __future__ import annotations

import pytest

from dtjob.trainer.collectives import halving_doubling, ring
from dtjob.trainer.collectives.peers import balanced_bounds


def _chunk_of(index: int, k: int) -> int:
    return index // k


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
@pytest.mark.parametrize("numel", [1, 5, 1000, 100_003])
@pytest.mark.parametrize("segment_bytes", [None, 1024])
def test_ring_layout_moves_every_chunk_once_per_step_and_ends_where_it_should(
    n: int, numel: int, segment_bytes: int | None
) -> None:
    bounds = tuple(balanced_bounds(numel, n))
    for rank in range(n):
        lay = ring._layout(bounds, rank, 4, segment_bytes)
        k = lay.k
        assert sum(lay.sizes) == numel and len(lay.sizes) == n * k
        for c in range(n):  # the segments of chunk c tile it
            assert sum(lay.sizes[c * k : (c + 1) * k]) == bounds[c + 1] - bounds[c]
        reduced = [{_chunk_of(i, k) for i in step} for step in lay.reduce_steps]
        assert all(len(chunks) == 1 for chunks in reduced)
        # The reduce-scatter receives every chunk but r-1 (which it starts by sending) and ends on r.
        assert [c.pop() for c in reduced] == [(rank - s - 2) % n for s in range(n - 1)]
        assert {_chunk_of(i, k) for i in lay.reduce_first} == {(rank - 1) % n}
        # What step s receives is what the neighbour sent: its step s-1 receive (or its first send).
        nxt = ring._layout(bounds, (rank + 1) % n, 4, segment_bytes)
        assert nxt.reduce_steps[0] == lay.reduce_first
        assert nxt.reduce_steps[1:] == lay.reduce_steps[:-1]
        assert nxt.gather_steps[0] == lay.gather_first
        assert nxt.gather_steps[1:] == lay.gather_steps[:-1]
        # The all-gather fills every chunk but our own.
        gathered = {_chunk_of(i, k) for step in lay.gather_steps for i in step}
        assert gathered == set(range(n)) - {rank}
        for step, cut in zip(lay.reduce_steps, lay.area_sizes, strict=True):
            assert sum(cut) == lay.largest and cut[:k] == tuple(lay.sizes[i] for i in step)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("numel", [3, 1000, 100_003])
@pytest.mark.parametrize("segment_bytes", [None, 1024])
def test_halving_doubling_plan_pairs_each_send_with_the_partners_receive(
    n: int, numel: int, segment_bytes: int | None
) -> None:
    vbounds = tuple(balanced_bounds(numel, n))
    plans = [halving_doubling._plan(vbounds, n, rank, 4, segment_bytes) for rank in range(n)]
    for rank, (halves, scratch, doubles) in enumerate(plans):
        assert len(halves) == len(doubles) == n.bit_length() - 1
        # Halving: the scratch areas of the steps follow each other and fill the scratch exactly.
        assert halves[0].targets[0][0] == 0 and halves[-1].targets[-1][1] == scratch
        for t, ex in enumerate(halves):
            mine = plans[ex.peer][0][t]
            assert mine.peer == rank
            sent = [hi - lo for lo, hi in ex.sends]
            assert sent == [hi - lo for lo, hi in mine.targets]
            assert ex.reduce_into is not None
            assert [hi - lo for lo, hi in ex.reduce_into] == [hi - lo for lo, hi in ex.targets]
            # What we keep is what the partner gives away, segment by segment.
            assert mine.sends == ex.reduce_into
        for t, ex in enumerate(doubles):
            theirs = plans[ex.peer][2][t]
            assert theirs.peer == rank and theirs.sends == ex.targets and ex.reduce_into is None
        # After halving, rank v's block is what its last step kept.
        assert halves[-1].reduce_into is not None
        assert (halves[-1].reduce_into[0][0], halves[-1].reduce_into[-1][1]) == (
            vbounds[rank],
            vbounds[rank + 1],
        )
