"""Which stage runs which micro-batch when: GPipe and 1F1B as per-stage action lists.

GPipe: every forward, then every backward. Stage s holds all M micro-batches' activations at the
    peak.
1F1B: stage s runs P-s-1 warm-up forwards, then alternates one forward and one backward, then
    drains the remaining backwards. A micro-batch's activations are freed by its backward, so
    stage s never holds more than P-s of them (at most P, instead of M).

Both have the same bubble: (P-1) idle slots out of M+P-1 per stage, a fraction (P-1)/(M+P-1).
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
    if schedule == "gpipe":
        return forwards + backwards
    if schedule != "1f1b":
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    warmup = min(stages - stage - 1, microbatches)
    actions = forwards[:warmup]
    for i in range(microbatches - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[microbatches - warmup :]


def split_stages(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) block ranges, as equal in count as possible (earlier stages get extras)."""
    if stages > n_blocks:
        raise ValueError(
            f"pipeline_stages={stages} exceeds the model's {n_blocks} blocks; use at most {n_blocks} stages"
        )
    base, extra = divmod(n_blocks, stages)
    ranges = []
    lo = 0
    for s in range(stages):
        hi = lo + base + (1 if s < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges
