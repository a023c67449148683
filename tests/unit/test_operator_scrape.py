"""Rank 0's metrics in the background: a pass gets the last answer at once, a silent rank 0 is
asked less and less often, and a new step triggers a pass."""

from __future__ import annotations

import threading
from typing import Any

from dtjob.operator.progress import TrainerProgress
from dtjob.operator.scrape import Scraper, ScrapeTarget
from dtjob.operator.settings import ObserverSettings

SETTINGS = ObserverSettings(scrape_interval_seconds=1.0, scrape_backoff_max_seconds=8.0)
JOB = ("ns", "gpt")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scraper(answers: list[Any]) -> tuple[Scraper, Clock, list[tuple[str, str]], list[str]]:
    clock, fired, asked = Clock(), [], []
    done = threading.Semaphore(0)

    def fetch(url: str, timeout: float) -> TrainerProgress:
        asked.append(url)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    # The scrapes a scrape schedules are left out here: the test's clock decides when one is due.
    s = Scraper(SETTINGS, lambda ns, name: fired.append((ns, name)), fetch, clock, lambda delay, fn: None)
    original = s._run

    def run(job: Any, state: Any) -> None:
        original(job, state)
        done.release()

    s._run = run  # type: ignore[method-assign]
    s.done = done  # type: ignore[attr-defined]
    return s, clock, fired, asked


def test_a_pass_gets_the_last_answer_at_once_and_a_new_step_triggers_a_pass() -> None:
    s, clock, fired, asked = scraper(
        [TrainerProgress(step=5), TrainerProgress(step=5), TrainerProgress(step=6)]
    )
    target = ScrapeTarget("uid-0", "http://10.244.1.5:9400/metrics")
    assert s.latest(JOB, target) is None, "nothing yet: the scrape runs in the background"
    assert s.done.acquire(timeout=5)  # type: ignore[attr-defined]
    assert s.latest(JOB, target) == TrainerProgress(step=5) and fired == [JOB]
    assert len(asked) == 1, "not due again before scrape_interval_seconds"
    clock.now = 1.0
    s.latest(JOB, target)
    assert s.done.acquire(timeout=5)  # type: ignore[attr-defined]
    assert fired == [JOB], "the same answer triggers nothing"
    clock.now = 2.0
    s.latest(JOB, target)
    assert s.done.acquire(timeout=5)  # type: ignore[attr-defined]
    assert s.latest(JOB, target) == TrainerProgress(step=6) and fired == [JOB, JOB]


def test_a_silent_rank_0_is_asked_after_1_2_4_8_8_seconds() -> None:
    s, clock, _, asked = scraper([OSError("no route to host")] * 10)
    target = ScrapeTarget("uid-0", "http://10.244.192.7:9400/metrics")
    tries = []
    for tick in range(0, 40):
        clock.now = float(tick)
        before = len(asked)
        s.latest(JOB, target)
        if len(asked) > before or s._jobs[JOB].in_flight:
            assert s.done.acquire(timeout=5)  # type: ignore[attr-defined]
            tries.append(tick)
    assert tries == [0, 1, 3, 7, 15, 23, 31, 39]
    assert s.latest(JOB, target) is None


def test_a_job_with_a_progress_deadline_is_asked_at_least_every_quarter_of_it() -> None:
    s, clock, _, asked = scraper([OSError("connection refused")] * 20)
    target = ScrapeTarget("uid-0", "http://10.244.1.9:9400/metrics")
    tries = []
    for half in range(0, 24):
        clock.now = half / 2
        before = len(asked)
        s.latest(JOB, target, progress_deadline=6)
        if len(asked) > before or s._jobs[JOB].in_flight:
            assert s.done.acquire(timeout=5)  # type: ignore[attr-defined]
            tries.append(clock.now)
    # 1 s, then 1.5 s (6 / 4) instead of 2, 4, 8: a trainer that starts answering is read in time
    assert tries == [0.0, 1.0, 2.5, 4.0, 5.5, 7.0, 8.5, 10.0, 11.5]


def test_a_new_rank_0_starts_with_nothing() -> None:
    s, _clock, _, _ = scraper([TrainerProgress(step=9), OSError("refused")])
    s.latest(JOB, ScrapeTarget("uid-0", "http://a/metrics"))
    assert s.done.acquire(timeout=5)  # type: ignore[attr-defined]
    assert s.latest(JOB, ScrapeTarget("uid-0", "http://a/metrics")) == TrainerProgress(step=9)
    assert s.latest(JOB, ScrapeTarget("uid-1", "http://b/metrics")) is None, "the next generation's rank 0"
    assert s.done.acquire(timeout=5)  # type: ignore[attr-defined]


def test_once_asked_a_rank_0_is_scraped_on_its_own_until_the_job_is_forgotten() -> None:
    answers = iter(
        [TrainerProgress(step=1), TrainerProgress(step=1), OSError("refused")]
        + [TrainerProgress(step=n) for n in range(2, 100)]
    )
    fired: list[tuple[str, str]] = []
    asked = threading.Semaphore(0)

    def fetch(url: str, timeout: float) -> TrainerProgress:
        asked.release()
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    fast = ObserverSettings(scrape_interval_seconds=0.05, scrape_backoff_max_seconds=0.05)
    s = Scraper(fast, lambda ns, name: fired.append((ns, name)), fetch)
    s.latest(JOB, ScrapeTarget("uid-0", "http://a/metrics"))  # the only pass that asks
    for _ in range(6):  # step 1, step 1 (no change), refused, steps 2, 3, 4
        assert asked.acquire(timeout=5), "no scrape after the first: scrapes must go on without passes"
    assert fired.count(JOB) >= 3, f"every new step triggers a pass: {fired}"
    assert s.latest(JOB, ScrapeTarget("uid-0", "http://a/metrics")) is not None
    s.forget(JOB)
    while asked.acquire(timeout=0.3):  # the scrape in flight or scheduled when forgotten
        pass
    assert not asked.acquire(timeout=0.5), "a forgotten job is scraped no more"
