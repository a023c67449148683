"""The yardstick of tests/e2e/test_goodput.py: tests/e2e/step_clock.py's log arithmetic against a
hand-computed timeline, and its pacer against a stand-in trainer that honours the step gate."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

from tests.e2e.step_clock import Stamped, StepClock, gang_changes, kept_seconds, redone_steps


def line(step: int, at: float, generation: int = 0, in_place: int = 0) -> Stamped:
    return Stamped(step, (generation, in_place), 3, at)


# Gang 0 steps 1-5 at t=10..14; killed, gang 1 resumes from step 3 at t=20 (steps 4, 5 redone)
# and runs to step 7 at t=24; a restart in place resumes from 6 at t=30 (6, 7 redone), step 8 at 31.
TIMELINE = [
    *(line(s, 9.0 + s) for s in range(1, 6)),
    *(line(s, 16.0 + s, generation=1) for s in range(4, 8)),
    line(6, 30.0, generation=1, in_place=1),
    line(7, 30.5, generation=1, in_place=1),
    line(8, 31.0, generation=1, in_place=1),
]


def test_steps_logged_again_are_the_redone_ones() -> None:
    assert redone_steps(TIMELINE) == [4, 5, 6, 7]


def test_gang_changes_pair_the_last_line_of_a_gang_with_the_first_of_the_next() -> None:
    assert [(a.step, a.at, b.step, b.at) for a, b in gang_changes(TIMELINE)] == [
        (5, 14.0, 4, 20.0),
        (7, 23.0, 6, 30.0),
    ]


def test_kept_time_is_the_fresh_steps_between_lines_of_one_gang() -> None:
    # gang 0: 1->5, 4 s; gang 1: 4->5 redone, 5->6 and 6->7 fresh (2 s); in place: 6->7 redone,
    # 7->8 fresh (0.5 s). The first line of a gang keeps nothing.
    assert kept_seconds(TIMELINE) == 4.0 + 2.0 + 0.5


def _trainer(log: Path, gate: Path, first: int, last: int, generation: int) -> None:
    """Runs steps first..last, each once the gate allows it, and logs it as rank 0 does."""
    with log.open("a") as out:
        for step in range(first, last + 1):
            while int(gate.read_text() or 0) < step:
                time.sleep(0.002)
            record = {"step": step, "generation": generation, "in_place_restarts": 0, "world_size": 2}
            out.write(json.dumps(record) + "\n")
            out.flush()


def test_the_clock_paces_one_step_a_period_and_holds_at_its_limit(
    tmp_path: Path,
) -> None:
    log, gate, period = tmp_path / "steps.jsonl", tmp_path / "gate", 0.1
    gate.write_text("0")
    with StepClock(log, gate, period, limit=4) as clock:
        first = threading.Thread(target=_trainer, args=(log, gate, 1, 4, 0))
        first.start()
        clock.wait_step(4, timeout=10)
        first.join(timeout=10)
        time.sleep(3 * period)
        assert gate.read_text() == "4", "held at the limit"
        clock.limit = 8
        _trainer(log, gate, 3, 8, 1)  # resumes from step 2: 3 and 4 again
        clock.wait_step(8, generation=1, timeout=10)
    lines = clock.lines()
    gen0 = [(s, 0) for s in range(1, 5)]
    assert [(s.step, s.gang[0]) for s in lines] == [*gen0, *((s, 1) for s in range(3, 9))]
    # A step past the highest one logged is opened a period after the line before it, and its
    # line is seen after that (the stamp is when the clock read it): never sooner.
    paced = [b.at - a.at for a, b in itertools.pairwise(lines) if b.step > 4]
    assert len(paced) == 4 and all(gap >= period for gap in paced), paced
    assert gate.read_text() == "8"
