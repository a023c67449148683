"""Operator e2e on the devcluster: what the operator does when a gang hangs, with a scripted
trainer (tests/e2e/plain_trainer.py): survivors exiting 76 name the lost rank and the gang
restarts counted; a step that stops advancing for progressDeadlineSeconds restarts it too."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import Devcluster, wait_for
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    condition,
    events,
    job_manifest,
    operator_namespace,
    wait_phase,
    wait_status,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PLAIN_TRAINER = Path(__file__).with_name("plain_trainer.py")


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-hangs")


def gate(op: Operator, name: str) -> Path:
    return SCRATCH / op.namespace / name / "logs" / "done"


def running_in(generation: int) -> Any:
    return lambda s: (s.get("generation"), s.get("phase")) == (generation, "Running")


def steps_in(st: dict[str, Any], generation: int, step: int) -> bool:
    """Whether generation `generation` reported at least `step`; fails on any later generation."""
    assert int(st.get("generation") or 0) <= generation, f"restarted again: {st}"
    return st.get("generation") == generation and int(st.get("step") or 0) >= step


def _event(op: Operator, name: str, reason: str) -> dict[str, Any]:
    """The job's first event of `reason` (waited for: it may be written after the status)."""
    wait_for(f"{name}: a {reason} event", lambda: any(e["reason"] == reason for e in events(op, name)))
    return next(e for e in events(op, name) if e["reason"] == reason)


def record(measurement: dict[str, object]) -> None:
    print(json.dumps(measurement))
    with (SCRATCH / "measurements.jsonl").open("a") as out:
        out.write(json.dumps(measurement) + "\n")


def test_survivors_of_a_lost_peer_restart_the_gang_counted_naming_the_rank(op: Operator) -> None:
    command = [sys.executable, str(PLAIN_TRAINER), "/steplog/done", "--lose-rank", "1", "--after", "3"]
    manifest = job_manifest(op, "lost", replicas=3, command=command)
    manifest["spec"]["elastic"]["heartbeatTimeoutSeconds"] = 4
    apply(manifest)
    wait_phase(op, "lost", "Running")
    wait_status(op, "lost", "a counted restart", lambda s: s.get("restarts") == 1, timeout=60)
    seen_at = time.monotonic()
    # The event, not the Restarting condition: the next generation may already run (the
    # condition then says so) by the time the restart count is seen.
    warning = _event(op, "lost", "PeerLost")
    assert warning["type"] == "Warning"
    # The restart starts at the first survivor's exit 76; the other may exit in the same pass.
    survivors = ("lost-worker-0", "lost-worker-2", "lost-worker-0, lost-worker-2")
    assert any(
        f"rank 1 (lost-worker-1) lost: no heartbeat for 4s ({who} exited 76)" in warning["message"]
        for who in survivors
    ), warning
    # rank 1 never exits by itself (as a hung rank): it gets SIGTERM with the short grace
    in_generation_1 = wait_status(op, "lost", "generation 1 running", running_in(1), timeout=60)
    record(
        {
            "measure": "peer_lost_restart_seen_to_next_generation_running_seconds",
            "value": round(time.monotonic() - seen_at, 1),
        }
    )
    running = in_generation_1
    assert running["restarts"] == 1
    gate(op, "lost").touch()
    assert wait_phase(op, "lost", "Succeeded", timeout=60)["restarts"] == 1


def test_a_step_that_stops_advancing_restarts_the_gang_counted(op: Operator) -> None:
    command = [sys.executable, str(PLAIN_TRAINER), "/steplog/done", "--serve-step", "7"]
    manifest = job_manifest(op, "stall", replicas=2, command=command)
    manifest["spec"]["elastic"]["progressDeadlineSeconds"] = 6
    apply(manifest)
    wait_phase(op, "stall", "Running")
    st = wait_status(op, "stall", "the step seen", lambda s: s.get("step") == 7, timeout=60)
    available = condition(st, "MetricsAvailable")
    assert (available["status"], available["reason"]) == ("True", "StepOnly")
    wait_status(op, "stall", "a counted restart", lambda s: s.get("restarts") == 1, timeout=60)
    warning = _event(op, "stall", "ProgressDeadlineExceeded")
    assert "step 7 has not advanced for" in warning["message"], warning
    # Generation 1's step advances one a second: past the deadline's length of running, no
    # second restart (a moving step is progress).
    first = wait_status(op, "stall", "generation 1 stepping", lambda s: steps_in(s, 1, 8), timeout=90)
    wait_status(
        op, "stall", "generation 1 past the deadline", lambda s: steps_in(s, 1, first["step"] + 8), timeout=60
    )
    gate(op, "stall").touch()
    done = wait_phase(op, "stall", "Succeeded", timeout=60)
    assert (done["restarts"], done["generation"]) == (1, 1)
    wait_for(
        "no ProgressDeadlineExceeded beyond the first",
        lambda: [e["reason"] for e in events(op, "stall")].count("ProgressDeadlineExceeded") == 1,
        timeout=5,
    )
