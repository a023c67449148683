"""The chaos suite's counts: one `Outcome` per injected fault, summed up per kind into the table
of bench/README.md (`make chaos` writes it to bench/results/chaos.json too)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    """One injected fault and what followed it, times in seconds after the injection.

    exited: the job's first worker exit seen (a pod watch): the gang's own detection; exit_code its code.
    detected: the job's status first showed the gang restarting (restarts or generation up), as
    polled from the API server; None when it never did (a planned rescale). For volume-full: the
    job showed the refused write (condition CheckpointWriteFailing), counted from rank 0 logging
    the checkpoint's step.
    training_again: rank 0 first logged a step of a later generation (the step log); for
    volume-full, the step after the refused checkpoint's.
    steps_lost: steps run before the fault and run again after it.
    from_memory: the new gang resumed from the in-memory snapshots (its first step log record says
    resumed_from "memory"), not from a durable checkpoint."""

    kind: str
    job: str
    detected: float | None
    training_again: float | None
    steps_lost: int
    resumed_from: int
    damaged_step: int | None = None
    exited: float | None = None
    exit_code: int | None = None
    from_memory: bool = False


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of a small sample; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """Per kind: injected, detection and fault-to-training-again p50/p95, steps lost (total, max)."""
    table: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(o.kind for o in outcomes):
        rows = [o for o in outcomes if o.kind == kind]
        detected = [o.detected for o in rows if o.detected is not None]
        exited = [o.exited for o in rows if o.exited is not None]
        again = [o.training_again for o in rows if o.training_again is not None]
        table[kind] = {
            "injected": len(rows),
            "exited_p50_s": percentile(exited, 50),
            "exited_p95_s": percentile(exited, 95),
            "detected_p50_s": percentile(detected, 50),
            "detected_p95_s": percentile(detected, 95),
            "training_again_p50_s": percentile(again, 50),
            "training_again_p95_s": percentile(again, 95),
            "steps_lost_total": sum(o.steps_lost for o in rows),
            "steps_lost_max": max(o.steps_lost for o in rows),
        }
    return table


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(table: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| fault | injected | first worker exit p50 / p95 (s) | restart on the job p50 / p95 (s) "
        "| training again p50 / p95 (s) | steps lost (total, max) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, r in table.items():
        lines.append(
            f"| {kind} | {r['injected']} | {_cell(r.get('exited_p50_s'))} / {_cell(r.get('exited_p95_s'))} "
            f"| {_cell(r['detected_p50_s'])} / {_cell(r['detected_p95_s'])} "
            f"| {_cell(r['training_again_p50_s'])} / {_cell(r['training_again_p95_s'])} "
            f"| {r['steps_lost_total']}, {r['steps_lost_max']} |"
        )
    return "\n".join(lines)


def write(
    path: Path, outcomes: Sequence[Outcome], jobs: dict[str, dict[str, Any]], meta: dict[str, Any]
) -> None:
    """The run as JSON: meta (seed, rounds, seconds), the per-kind table, every outcome, every job's end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {**meta, "table": summarize(outcomes), "outcomes": [asdict(o) for o in outcomes], "jobs": jobs}
    path.write_text(json.dumps(body, indent=1) + "\n")


if __name__ == "__main__":  # `python -m tests.chaos.report FILE`: the table of a written run
    import sys

    print(markdown(json.loads(Path(sys.argv[1]).read_text())["table"]))
