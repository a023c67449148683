"""Count the bytes and seconds of every collective the strategies issue, by op and algorithm.

All strategies move their data through `dtjob.trainer.parallel.comm.Comm`, so that class is
wrapped once per process: each call adds the bytes of its tensor(s) and, when its handle's
`wait()` returns (at once for a synchronous call), the seconds from issue to completion. Seconds
of overlapping asynchronous calls therefore overlap too: they measure how long each collective
was in flight, not wall time spent blocked. Pipeline point-to-point transfers are not counted.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

from dtjob.trainer.metrics import TrainerMetrics
from dtjob.trainer.parallel.comm import Comm

# Comm method -> (op label, index of the argument whose bytes are the payload)
_METHODS: dict[str, tuple[str, int]] = {
    "all_reduce_sum": ("all_reduce", 0),
    "reduce_scatter_sum": ("reduce_scatter", 1),
    "all_gather": ("all_gather", 0),
    "broadcast": ("broadcast", 0),
}
_installed: list[TrainerMetrics] = []


class _TimedHandle:
    def __init__(self, inner: Any, done: Callable[[], None]) -> None:
        self._inner = inner
        self._done: Callable[[], None] | None = done

    def wait(self) -> Any:
        result = self._inner.wait()
        if self._done is not None:
            self._done()
            self._done = None
        return result


def _wrap(method: Callable[..., Any], op: str, payload_arg: int) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def timed(self: Comm, *args: Any, **kwargs: Any) -> Any:
        payload: torch.Tensor = args[payload_arg]
        nbytes = payload.numel() * payload.element_size()
        started = time.perf_counter()
        handle = method(self, *args, **kwargs)
        algorithm = self.algorithm

        def done() -> None:
            for metrics in _installed:
                metrics.observe_collective(op, algorithm, nbytes, time.perf_counter() - started)

        if not signature.bind(self, *args, **kwargs).arguments.get("async_op", False):
            done()
            return handle
        return _TimedHandle(handle, done)

    return timed


def instrument_comm(metrics: TrainerMetrics) -> None:
    """Report every `Comm` collective of this process to `metrics` (idempotent per metrics)."""
    if not _installed:
        for name, (op, payload_arg) in _METHODS.items():
            setattr(Comm, name, _wrap(getattr(Comm, name), op, payload_arg))
    if metrics not in _installed:
        _installed.append(metrics)
