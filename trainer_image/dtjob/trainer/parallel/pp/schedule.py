"""Which stage runs which micro-batch when: GPipe and 1F1B as per-stage action lists.

GPipe: every forward, then every backward. Stage s holds all M micro-batches' activations at the
    peak.
1F1B: stage s runs P-s-1 warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards. A micro-batch's activations are freed by its backward, so
    stage s never holds more than P-s of them (at most P, instead of M).

"forward" (eval_step): every forward, no backward.

GPipe and 1F1B have the same bubble: (P-1) idle slots out of M+P-1 per stage, a fraction (P-1)/(M+P-1).

`exchanges` adds the point-to-point traffic: between two consecutive actions a stage sends what
the first produced and receives what the second needs, all in one batch (see wire.py for why).
"""

from __future__ import annotations

from typing import Literal, NamedTuple


class Action(NamedTuple):
    kind: Literal["F", "B"]
    microbatch: int


def schedule_actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    forwards = [Action("F", m) for m in range(microbatches)]
    backwards = [Action("B", m) for m in range(microbatches)]
    if schedule == "forward":
        return forwards
    if schedule == "gpipe":
        return forwards + backwards
    if schedule != "1f1b":
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    warmup = min(stages - stage - 1, microbatches)
    actions = forwards[:warmup]
    for i in range(microbatches - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[microbatches - warmup :]


class P2P(NamedTuple):
    """One message: activations ("F") of a micro-batch going forward, or their gradients ("B")
    coming back; `peer` is the other stage."""

    op: Literal["send", "recv"]
    peer: int
    kind: Literal["F", "B"]
    microbatch: int


class Step(NamedTuple):
    """One batch of messages, then one action (None after the last action: only its sends)."""

    exchange: list[P2P]
    action: Action | None


def _sends(action: Action, stage: int, stages: int) -> list[P2P]:
    if action.kind == "F":
        return [P2P("send", stage + 1, "F", action.microbatch)] if stage < stages - 1 else []
    return [P2P("send", stage - 1, "B", action.microbatch)] if stage > 0 else []


def _recvs(action: Action, stage: int, stages: int) -> list[P2P]:
    if action.kind == "F":
        return [P2P("recv", stage - 1, "F", action.microbatch)] if stage > 0 else []
    return [P2P("recv", stage + 1, "B", action.microbatch)] if stage < stages - 1 else []


def exchanges(schedule: str, stage: int, stages: int, microbatches: int) -> list[Step]:
    """Stage `stage`'s actions, each preceded by the batch that sends the previous action's
    outputs and receives this one's inputs; a last batch sends the last action's outputs.

    Every stage runs its forwards, and its backwards, in micro-batch order, so the k-th
    activation stage s sends is the k-th that stage s + 1 receives (likewise for gradients)."""
    actions = schedule_actions(schedule, stage, stages, microbatches)
    steps = []
    previous: list[P2P] = []
    for action in actions:
        steps.append(Step(previous + _recvs(action, stage, stages), action))
        previous = _sends(action, stage, stages)
    return [*steps, Step(previous, None)]


def split_stages(n_blocks: int, stages: int, costs: list[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) block ranges, one per stage, each non-empty.

    With `costs` (e.g. each block's parameter count), the split minimises the costliest stage,
    since the slowest stage sets the pipeline's pace; without, blocks are shared out evenly.
    """
    if stages > n_blocks:
        raise ValueError(
            f"pipeline_stages={stages} exceeds the model's {n_blocks} blocks; use at most {n_blocks} stages"
        )
    if costs is None:
        costs = [1] * n_blocks
    if len(costs) != n_blocks:
        raise ValueError(f"got {len(costs)} block costs for {n_blocks} blocks")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the smallest possible costliest stage when the first i blocks form s stages.
    inf = float("inf")
    best = [[inf] * (n_blocks + 1) for _ in range(stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n_blocks - (stages - s) + 1):
            for j in range(s - 1, i):  # the last stage holds blocks j..i-1
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    ranges = []
    hi = n_blocks
    for s in range(stages, 0, -1):
        lo = cut[s][hi]
        ranges.append((lo, hi))
        hi = lo
    return ranges[::-1]
