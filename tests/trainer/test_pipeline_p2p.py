"""The pipeline's point-to-point traffic runs to the end under NCCL's rules (see _p2p_check.py).

Every exchange between two actions is one batch, and each pair of stages issues its sends and
receives in the same order: on the plan (schedule.exchanges) for every schedule, 2-4 stages and
1-6 micro-batches, and on what real gloo pipelines issue.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

from dtjob.trainer.parallel.pp.schedule import P2P, exchanges
from tests.trainer import _parallel_harness as h
from tests.trainer._p2p_check import Item, Op, check, deadlock, traces_from_calls

SCHEDULES = ("gpipe", "1f1b")


def plan_traces(schedule: str, stages: int, microbatches: int) -> dict[int, list[Item]]:
    """What Pipeline._exchange issues for each stage's plan: per exchange, a header out for each
    activation it sends, then a header read for each it receives, then one batch."""
    traces: dict[int, list[Item]] = {}
    for s in range(stages):
        items: list[Item] = []
        for step in exchanges(schedule, s, stages, microbatches):
            items += [("hsend", s, op.peer, 0) for op in step.exchange if op.op == "send" and op.kind == "F"]
            items += [("hrecv", op.peer, s, 0) for op in step.exchange if op.op == "recv" and op.kind == "F"]
            if step.exchange:
                ops = [Op(op.op, op.peer, (op.kind, op.microbatch)) for op in step.exchange]
                items.append(("batch", ops))
        traces[s] = items
    return traces


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 6])
def test_plan_is_batched_paired_and_runs_to_the_end(schedule: str, stages: int, microbatches: int) -> None:
    check(plan_traces(schedule, stages, microbatches))
    for s in range(stages):
        steps = exchanges(schedule, s, stages, microbatches)
        assert steps[-1].action is None
        for i, step in enumerate(steps[:-1]):
            assert step.action is not None
            kind, m = step.action
            # An action's input arrives in the batch just before it, its output leaves just after.
            peer_in, peer_out = (s - 1, s + 1) if kind == "F" else (s + 1, s - 1)
            if 0 <= peer_in < stages:
                assert P2P("recv", peer_in, kind, m) in step.exchange
            if 0 <= peer_out < stages:
                assert P2P("send", peer_out, kind, m) in steps[i + 1].exchange
        messages = [op for step in steps for op in step.exchange]
        assert len(messages) == len(set(messages)) == microbatches * (2 if s in (0, stages - 1) else 4)


def unbatched_traces(schedule: str, stages: int, microbatches: int) -> dict[int, list[Item]]:
    """The same messages, each sent or received on its own (what the pipeline did before)."""
    traces = plan_traces(schedule, stages, microbatches)
    return {
        s: [("batch", [op]) for item in items for op in (item[1] if item[0] == "batch" else [None]) if op]
        for s, items in traces.items()
    }


def test_the_checker_finds_the_deadlock_of_unbatched_1f1b() -> None:
    """Stage 0 sends activation 1 before it receives gradient 0; stage 1 sends gradient 0 before
    it receives activation 1: under NCCL both sends wait for their receives forever."""
    stuck = deadlock(unbatched_traces("1f1b", 2, 2))
    assert stuck is not None and "rank 0" in stuck and "rank 1" in stuck, stuck
    # GPipe's unbatched order happens to run through with 2 stages: the checker is not just
    # rejecting every unbatched trace.
    assert deadlock(unbatched_traces("gpipe", 2, 2)) is None


# -- what real pipelines issue ---------------------------------------------------------------------
# (stages, microbatches) per world size; world 4 with 2 stages is 2 replicas x 2 stages.
TRACED = {3: [(3, 2), (3, 4)], 4: [(4, 2), (4, 5), (2, 1)]}


def _trace_cases(world: int) -> list[dict[str, Any]]:
    return [
        {
            "name": f"trace-pp{stages}-{schedule}-m{microbatches}",
            "config": {
                "strategy": "pipeline",
                "pipeline_stages": stages,
                "microbatches": microbatches,
                "schedule": schedule,
                "collective": "native",
            },
            "batch": 20 if microbatches == 5 else 24,
            "steps": 2,
            "trace_p2p": True,
        }
        for stages, microbatches in TRACED[world]
        for schedule in SCHEDULES
    ]


@functools.cache
def _traced(world: int) -> list[dict[str, Any]]:
    return h.run_world(world, _trace_cases(world))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "name"), [(w, c["name"]) for w in TRACED for c in _trace_cases(w)])
def test_real_pipeline_traffic_is_batched_paired_and_runs_to_the_end(world: int, name: str) -> None:
    results = _traced(world)
    for rank, result in enumerate(results):
        assert "error" not in result.get(name, {}), f"rank {rank}: {result[name]['error']}"
    traces, unbatched = traces_from_calls([r[name]["p2p"] for r in results])
    assert not unbatched, f"{len(unbatched)} data operations outside a batch, e.g. {unbatched[:4]}"
    assert any(item[0] == "batch" for item in traces[0])
    check(traces)
