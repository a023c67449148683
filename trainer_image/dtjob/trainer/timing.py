"""How long a step (or a collective) took on the device that ran it.

On CUDA a kernel launch returns at once: the wall clock read right after a step's last launch
measures the launches, not the step (#41: tokens/s and MFU were read that way, several times too
high at small steps). On CUDA an `Interval` records events on the current stream at its start and
its stop, and its seconds come from `Event.elapsed_time` once the stop event is done; on the CPU
the two are `time.perf_counter()` readings and done at once.

`StepTimer` keeps the intervals of the steps whose events are not done yet and gives the newest
finished step's seconds without a `synchronize()`: in the built-in loop step s-1 is finished by the
time step s ends (`ElasticSession.report` reads the loss back to the host, which waits for the
stream), so the figure of step s is step s-1's on CUDA, of the same batch size. Only when no step
has finished yet (the first one) does it wait for the newest.
"""

from __future__ import annotations

import time
from collections import deque

import torch

# Unfinished steps a StepTimer keeps at most: a script that never waits for its GPU would
# otherwise queue events without end; the oldest is then waited for.
_MAX_PENDING = 8


class Interval:
    """From construction to `stop()` on `device`'s timeline (CUDA: the current stream)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._end: torch.cuda.Event | None = None
        self._stopped_at: float | None = None
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._started_at = time.perf_counter()

    @property
    def stopped(self) -> bool:
        return self._end is not None or self._stopped_at is not None

    def stop(self) -> None:
        """Mark the end (once: a second call keeps the first end)."""
        if self.stopped:
            return
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._stopped_at = time.perf_counter()

    def done(self) -> bool:
        """Stopped, and on CUDA the work before the stop finished (never blocks)."""
        if self._end is not None:
            return bool(self._end.query())
        return self._stopped_at is not None

    def seconds(self) -> float:
        """The interval's length; on CUDA waits for the stop event when it is not done yet."""
        if not self.stopped:
            raise RuntimeError("Interval.seconds() before stop()")
        if self._end is not None:
            self._end.synchronize()  # returns at once when done()
            return float(self._start.elapsed_time(self._end)) / 1000.0
        assert self._stopped_at is not None
        return self._stopped_at - self._started_at


class StepTimer:
    """Step times on the device's timeline; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: deque[Interval] = deque()
        self._newest: float | None = None  # seconds of the newest finished step

    def start(self) -> None:
        """A step begins (an unstopped previous step ends here)."""
        if self._pending:
            self._pending[-1].stop()
        self._pending.append(Interval(self.device))
        while len(self._pending) > _MAX_PENDING:
            self._newest = self._pending.popleft().seconds()

    def stop(self) -> None:
        """The current step's work is all issued (idempotent until the next `start()`)."""
        if self._pending:
            self._pending[-1].stop()

    def seconds(self) -> float:
        """Seconds of the newest finished step (CUDA: no wait unless none finished yet, then the
        newest stopped step's, waited for); 0.0 before any step."""
        while self._pending and self._pending[0].done():
            self._newest = self._pending.popleft().seconds()
        if self._newest is None:  # nothing finished yet: wait for what was stopped
            while self._pending and self._pending[0].stopped:
                self._newest = self._pending.popleft().seconds()
        return self._newest if self._newest is not None else 0.0
