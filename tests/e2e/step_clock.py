"""Rank 0's step log on a clock, for e2e tests that check the operator's accounts of a job
(status.goodput, status.recoveries, status.eta) against the trainer's own timeline.

The step log (operator_harness.job_manifest's `--log-file`) has no time in its lines, so
`StepClock` reads it every POLL_SECONDS and stamps each new line with the time it appeared; and it
paces the job through its step gate: one step every `period` seconds after the one before, up to
`limit`. A paced job steps at a known, steady rate, so the time of each step is the gang's, not a
race of a tiny model against the operator's scrapes.

The arithmetic (`redone_steps`, `gang_changes`, `kept_seconds`) is pure and follows
dtjob.operator.goodput: a gang is (generation, in_place_restarts); a step at or below the highest
step logged before is redone; the time between two lines of one gang goes to the steps done in
between, and is kept for those past the highest step before. A gang's first line has no line of
its own gang before it: the time it took is not known and not kept, as the operator's first
sample of a gang.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

# How often the log is read: each line's time is at most this late (and the gate this slow).
POLL_SECONDS = 0.02


@dataclass(frozen=True)
class Stamped:
    """One line of rank 0's step log, with the time.time() at which it was seen."""

    step: int
    gang: tuple[int, int]  # (generation, in_place_restarts)
    world_size: int
    at: float


class StepClock:
    """Stamps the lines of the step log `log` and opens the step gate `gate` (a file holding the
    last step the trainers may run) one step every `period` seconds, up to `limit` (settable)."""

    def __init__(self, log: Path, gate: Path, period: float, limit: int) -> None:
        self.log, self.gate, self.period, self.limit = log, gate, period, limit
        self._lines: list[Stamped] = []
        self._offset = 0
        self._opened = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-clock", daemon=True)

    def __enter__(self) -> StepClock:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        self._read()  # the lines written since the last poll

    def lines(self) -> list[Stamped]:
        with self._lock:
            return list(self._lines)

    def wait_step(self, step: int, generation: int = 0, timeout: float = 150.0) -> Stamped:
        """The first line of `step` (or later) of a generation `generation` or later."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.lines() if s.step >= step and s.gang[0] >= generation]
            if found:
                return found[0]
            time.sleep(POLL_SECONDS)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for step {step} of generation {generation}")

    def _run(self) -> None:
        while not self._done.is_set():
            self._read()
            self._pace()
            time.sleep(POLL_SECONDS)

    def _read(self) -> None:
        if not self.log.exists():
            return
        with self.log.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        now = time.time()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for its end
        self._offset += len(complete)
        found = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by SIGKILL
            if "step" in r:
                gang = (int(r["generation"]), int(r["in_place_restarts"]))
                found.append(Stamped(int(r["step"]), gang, int(r["world_size"]), now))
        with self._lock:
            self._lines += found

    def _pace(self) -> None:
        """The gate only opens further: a new gang redoes its steps up to it at once."""
        lines = self.lines()
        last = lines[-1] if lines else None
        if last is None:
            due = 1
        elif time.time() >= last.at + self.period:
            due = last.step + 1
        else:
            due = last.step
        wanted = min(self.limit, due)
        if wanted > self._opened:
            self.gate.write_text(str(wanted))
            self._opened = wanted


def redone_steps(lines: Sequence[Stamped]) -> list[int]:
    """The steps logged again (at or below the highest step logged before), in order."""
    out, highest = [], 0
    for s in lines:
        if s.step <= highest:
            out.append(s.step)
        highest = max(highest, s.step)
    return out


def gang_changes(lines: Sequence[Stamped]) -> list[tuple[Stamped, Stamped]]:
    """(last line of a gang, first line of the next gang) at each change of gang."""
    return [(a, b) for a, b in itertools.pairwise(lines) if a.gang != b.gang]


def kept_seconds(lines: Sequence[Stamped]) -> float:
    """The time that went into steps that were kept, as dtjob.operator.goodput.record counts it
    between two samples of one gang (here: two consecutive lines)."""
    kept, highest = 0.0, 0
    for a, b in itertools.pairwise(lines):
        if a.gang == b.gang and b.step > a.step:
            fresh = max(0, b.step - max(a.step, highest))
            kept += (b.at - a.at) * fresh / (b.step - a.step)
        highest = max(highest, a.step)
    return kept
