"""Rank 0's metrics, read in the background: a pass never waits for a scrape.

A pass asks `Scraper.latest(job, target)` for what rank 0 (`target`: its pod's uid and address)
last answered, which returns at once, and which schedules a fresh scrape when the last one is
older than `scrape_interval_seconds` and none is in flight. From then on the target is scraped on
its own, each scrape scheduling the next, until a pass asks for another target or `forget`s the
job (its rank 0 no longer runs): no pass runs only to keep the scrapes going. Scrapes run on a
pool of `scrape_workers` threads, each bounded by `metrics_timeout_seconds`; an answer that
differs from the one before triggers a pass of the job, so a new step shows at once.

A rank 0 that does not answer (a trainer still importing torch, one that publishes nothing, or a
simulated pod whose address no host answers) is asked again after 1 s, then 2 s, up to
`scrape_backoff_max_seconds`: 500 such jobs keep 32 threads busy with at most 32 connects a
second, whatever the timer, and never a pass. A job with `progressDeadlineSeconds` D is asked at
least every D/4 s even so: a new generation's rank 0 fails its first scrapes while it starts, and
at the 8 s cap a 6 s deadline ran out before its first step was read (the gang was restarted as
stalled, again and again).

Results belong to one target: a new generation's rank 0 (another pod uid) starts with nothing.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dtjob import contract
from dtjob.operator.coalescer import Later
from dtjob.operator.progress import TrainerProgress
from dtjob.operator.settings import ObserverSettings

log = logging.getLogger("dtjob.operator")
JobKey = tuple[str, str]


@dataclass(frozen=True)
class ScrapeTarget:
    uid: str
    url: str


@dataclass
class _State:
    target: ScrapeTarget
    progress_deadline: float | None = None
    result: TrainerProgress | None = None
    answered: bool = False
    last_try: float = float("-inf")  # monotonic
    failures: int = 0
    in_flight: bool = False


TRAINER_GAUGES = {
    contract.METRIC_STEP: "step",
    contract.METRIC_LAST_CHECKPOINT_STEP: "checkpoint_step",
    contract.METRIC_LAST_CHECKPOINT_TIME: "checkpoint_time",
    contract.METRIC_CHECKPOINT_FAILURES: "checkpoint_failures",
    contract.METRIC_TOTAL_STEPS: "total_steps",
    contract.METRIC_TOKENS_PER_SECOND: "tokens_per_second",
    contract.METRIC_MFU: "mfu",
    contract.METRIC_IN_PLACE_RESTART_FAILED_AT: "restart_failed_at",
    contract.METRIC_FIRST_STEP_TIME: "first_step_time",
    contract.METRIC_RESUMED_STEP: "resumed_step",
    contract.METRIC_RESUMED_STATE_TIME: "resumed_state_time",
    contract.METRIC_RESUME_LOST_STEP: "resume_lost_step",
}


# `dtjob_trainer_in_place_restarts{cause="..."} N` (the cause escaped as Prometheus escapes labels)
_IN_PLACE_SAMPLE = re.compile(
    re.escape(contract.METRIC_IN_PLACE_RESTARTS) + r'\{cause="((?:[^"\\]|\\.)*)"\} (\S+)'
)


def parse_trainer_metrics(text: str) -> TrainerProgress:
    """Pick the trainer's gauges out of Prometheus text exposition format."""
    values: dict[str, float] = {}
    in_place, cause = None, None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample = _IN_PLACE_SAMPLE.match(line)
        if sample is not None:
            try:
                in_place = int(float(sample.group(2)))
            except ValueError:
                continue
            cause = re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), sample.group(1))
            continue
        name, _, rest = line.partition(" ")
        name = name.split("{", 1)[0]
        if name in TRAINER_GAUGES:
            try:
                values[TRAINER_GAUGES[name]] = float(rest.split()[0])
            except (ValueError, IndexError):
                continue
    step = values.get("step")
    checkpoint_step = values.get("checkpoint_step")
    return TrainerProgress(
        step=None if step is None else int(step),
        # the trainer reports -1 (or nothing) before its first checkpoint
        checkpoint_step=None if checkpoint_step is None or checkpoint_step < 0 else int(checkpoint_step),
        checkpoint_time=values.get("checkpoint_time") or None,
        checkpoints_published=checkpoint_step is not None,
        checkpoint_failures=int(values["checkpoint_failures"]) if "checkpoint_failures" in values else None,
        in_place_restarts=in_place,
        restart_cause=cause or None,
        restart_failed_at=values.get("restart_failed_at") or None,  # an unset gauge reads 0
        first_step_time=values.get("first_step_time") or None,
        resumed_step=int(values["resumed_step"]) if "resumed_step" in values else None,
        resumed_state_time=values.get("resumed_state_time") or None,
        resume_lost_step=int(values["resume_lost_step"]) if values.get("resume_lost_step") else None,
        total_steps=int(values["total_steps"]) if "total_steps" in values else None,
        tokens_per_second=values.get("tokens_per_second"),
        mfu=values.get("mfu"),
    )


def _scrape(url: str, timeout: float) -> TrainerProgress:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_trainer_metrics(response.read().decode())


class Scraper:
    def __init__(
        self,
        settings: ObserverSettings,
        on_change: Callable[[str, str], None] | None = None,
        fetch: Callable[[str, float], TrainerProgress] = _scrape,
        clock: Callable[[], float] = time.monotonic,
        schedule: Callable[[float, Callable[[], object]], None] | None = None,
    ) -> None:
        self.settings = settings
        self.on_change = on_change
        self._fetch = fetch
        self._clock = clock
        # Runs the next scrape of a target `delay` seconds later (a test passes its own).
        self._schedule = schedule if schedule is not None else Later("scrape-next").call
        self._lock = threading.Lock()
        self._jobs: dict[JobKey, _State] = {}
        self._pool = ThreadPoolExecutor(settings.scrape_workers, thread_name_prefix="scrape")

    def latest(
        self, job: JobKey, target: ScrapeTarget, progress_deadline: float | None = None
    ) -> TrainerProgress | None:
        """What `target` last answered (None: nothing yet, or it never answered); schedules a
        scrape when one is due (at least every progress_deadline / 4 s, when given)."""
        with self._lock:
            state = self._jobs.get(job)
            if state is None or state.target != target:
                state = self._jobs[job] = _State(target)
            state.progress_deadline = progress_deadline
            self._start_if_due(job, state)
            return state.result if state.answered else None

    def _wait(self, state: _State) -> float:
        """Seconds between two scrapes of this target."""
        if state.failures == 0:
            wait = self.settings.scrape_interval_seconds
        else:
            wait = float(min(self.settings.scrape_backoff_max_seconds, 2 ** (state.failures - 1)))
        if state.progress_deadline is not None:
            wait = min(wait, max(self.settings.scrape_interval_seconds, state.progress_deadline / 4))
        return wait

    def _start_if_due(self, job: JobKey, state: _State) -> None:
        """Under the lock: submit a scrape of `state` when one is due and none is in flight."""
        if not state.in_flight and self._clock() >= state.last_try + self._wait(state):
            state.in_flight = True
            state.last_try = self._clock()
            self._pool.submit(self._run, job, state)

    def _next(self, job: JobKey, state: _State) -> None:
        """The scheduled next scrape: only while `state` is still the job's target, and none is
        in flight (that one schedules the next); not due yet (a pass's scrape came between), it
        is scheduled again for when it is."""
        with self._lock:
            if self._jobs.get(job) is not state or state.in_flight:
                return
            left = state.last_try + self._wait(state) - self._clock()
            if left <= 0:
                self._start_if_due(job, state)
                return
        self._schedule(left + 0.01, functools.partial(self._next, job, state))

    def forget(self, job: JobKey) -> None:
        with self._lock:
            self._jobs.pop(job, None)

    def _run(self, job: JobKey, state: _State) -> None:
        try:
            result: TrainerProgress | None = self._fetch(
                state.target.url, self.settings.metrics_timeout_seconds
            )
        except Exception as e:  # an unreachable or broken endpoint is an answer of "nothing"
            log.debug("no metrics from %s: %s", state.target.url, e)
            result = None
        with self._lock:
            state.in_flight = False
            changed = result is not None and (not state.answered or state.result != result)
            if result is None:
                state.failures += 1
            else:
                state.failures, state.result, state.answered = 0, result, True
            current = self._jobs.get(job) is state
            wait = self._wait(state)
        if not current:
            return
        # 10 ms late: the scheduler may wake a little early, and the scrape would not be due yet.
        self._schedule(wait + 0.01, functools.partial(self._next, job, state))
        if changed and self.on_change is not None:
            self.on_change(*job)
