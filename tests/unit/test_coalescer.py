"""The trigger coalescer: one run per key in flight, and every trigger answered by a run that
starts after it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from dtjob.operator.coalescer import Coalescer, Later


class HookLock:
    """A lock that calls `after_release(n)` (once, then disarms) right after its n-th release,
    outside the lock: the moment another thread's trigger could slip in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.releases = 0
        self.after_release: Callable[[int], None] | None = None

    def __enter__(self) -> HookLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()
        self.releases += 1
        hook, self.after_release = self.after_release, None
        if hook is not None:
            hook(self.releases)


def one_trigger_after_release(k: int) -> tuple[list[int], int | None]:
    """Trigger once; right after the k-th release of the guard, trigger again. Returns the start
    index of every run (runs started so far when it began) and when the second trigger came."""
    lock = HookLock()
    starts: list[int] = []
    coalescer: Coalescer[str] = Coalescer(lambda key: starts.append(len(starts)), lock=lock)
    second: list[int] = []

    def arm(n: int) -> None:
        if n < k:
            lock.after_release = arm
            return
        second.append(len(starts))
        coalescer.trigger("ns/job")

    lock.after_release = arm
    coalescer.trigger("ns/job")
    return starts, second[0] if second else None


@pytest.mark.parametrize("k", range(1, 6))
def test_a_trigger_after_any_release_of_the_guard_gets_a_run_that_starts_after_it(k: int) -> None:
    starts, second_at = one_trigger_after_release(k)
    if second_at is None:
        assert k > 2, "the guard is released at least twice in one run"
        return
    assert any(start >= second_at for start in starts), (
        f"the trigger after release {k} came when {second_at} runs had started; runs: {starts}"
    )


def test_triggers_during_a_run_coalesce_into_one_more_run() -> None:
    runs = 0
    inside = threading.Event()
    release = threading.Event()

    def work(key: str) -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            inside.set()
            release.wait(10)

    coalescer: Coalescer[str] = Coalescer(work)
    first = threading.Thread(target=coalescer.trigger, args=("a",))
    first.start()
    assert inside.wait(10)
    for _ in range(5):
        coalescer.trigger("a")  # returns at once: a run is in flight
    release.set()
    first.join(10)
    assert runs == 2


def test_never_two_runs_of_one_key_at_once_and_the_last_trigger_is_answered() -> None:
    in_flight: dict[str, int] = {"a": 0, "b": 0}
    overlap: list[str] = []
    last_start: dict[str, float] = {}
    guard = threading.Lock()

    def work(key: str) -> None:
        with guard:
            in_flight[key] += 1
            if in_flight[key] > 1:
                overlap.append(key)
            last_start[key] = time.monotonic()
        time.sleep(0.001)
        with guard:
            in_flight[key] -= 1

    coalescer: Coalescer[str] = Coalescer(work)
    last_trigger: dict[str, float] = {}

    def hammer(key: str) -> None:
        for _ in range(200):
            last_trigger[key] = time.monotonic()
            coalescer.trigger(key)

    threads = [threading.Thread(target=hammer, args=(key,)) for key in ("a", "a", "a", "b", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert overlap == []
    for key in ("a", "b"):
        assert last_start[key] >= last_trigger[key], f"the last trigger of {key} got no run after it"


def test_a_run_held_by_its_future_keeps_the_key_until_it_resolves_then_answers_the_triggers() -> None:
    held: list[Future[None]] = []
    runs: list[str] = []

    def work(key: str) -> Future[None] | None:
        runs.append(threading.current_thread().name)
        if len(runs) > 1:
            return None
        held.append(Future())
        return held[0]

    spawned: list[Callable[[], None]] = []
    coalescer: Coalescer[str] = Coalescer(work, spawn=spawned.append)
    coalescer.trigger("a")  # returns while its writes are in flight
    assert len(runs) == 1 and not spawned
    coalescer.trigger("a")
    coalescer.trigger("a")
    assert len(runs) == 1, "no second run while the first one's future is unresolved"
    held[0].set_result(None)
    assert len(spawned) == 1 and len(runs) == 1, "the next run starts through spawn, not in the resolver"
    spawned[0]()
    assert len(runs) == 2, "the triggers meanwhile are one more run"
    coalescer.trigger("a")
    assert len(runs) == 3, "the key is free again: the trigger runs in its own thread"


def test_a_held_run_without_triggers_meanwhile_frees_the_key() -> None:
    future: Future[None] = Future()
    runs = 0

    def work(key: str) -> Future[None] | None:
        nonlocal runs
        runs += 1
        return future if runs == 1 else None

    coalescer: Coalescer[str] = Coalescer(work, spawn=lambda fn: pytest.fail("nothing to run again"))
    coalescer.trigger("a")
    future.set_result(None)
    coalescer.trigger("a")
    assert runs == 2


def test_an_exception_leaves_the_key_free_for_the_next_trigger() -> None:
    calls = 0

    def work(key: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyboardInterrupt

    coalescer: Coalescer[str] = Coalescer(work)
    with pytest.raises(KeyboardInterrupt):
        coalescer.trigger("a")
    coalescer.trigger("a")
    assert calls == 2


def test_later_runs_each_call_after_its_delay_in_deadline_order() -> None:
    later = Later("test-later")
    start = time.monotonic()
    ran: list[tuple[str, float]] = []
    done = threading.Event()

    def record(name: str) -> None:
        ran.append((name, time.monotonic() - start))

    later.call(0.3, lambda: (record("late"), done.set()))
    later.call(0.1, lambda: record("early"))
    later.call(0.1, lambda: 1 / 0)  # a call that fails does not stop the ones after it
    later.call(0.1, lambda: record("early-too"))
    assert done.wait(10)
    assert [name for name, _ in ran] == ["early", "early-too", "late"]
    assert ran[0][1] >= 0.1 and ran[2][1] >= 0.3, "never before its delay"
