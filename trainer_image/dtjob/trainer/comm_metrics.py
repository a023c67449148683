"""Count the bytes and seconds of every collective the strategies issue, by op and algorithm.

The algorithm label is what ran, not what was asked for: with "auto" it is the algorithm auto
chose for that call (ring, hd, rd, direct, tree, ...), read from the call's handle or, for a
synchronous call, from `collectives.last_algorithm` right after it returned. A call that sends
nothing (a group of one, an empty tensor) is labelled "none": nothing ran and nothing was chosen.

All strategies move their data through `dtjob.trainer.parallel.comm.Comm`, so that class is
wrapped once per process: each call adds the bytes of its tensor(s) and, when its handle's
`wait()` returns (at once for a synchronous call), the seconds from issue to completion. Seconds
of overlapping asynchronous calls therefore overlap too: they measure how long each collective
was in flight, not wall time spent blocked. Seconds are on the payload's device's timeline
(dtjob.trainer.timing.Interval): on CUDA the wall clock at `wait()` saw only the launch (#41), so
events are recorded at issue and completion, and the call is reported once its completion event is
done (at a later call, without waiting for the GPU). The pipeline's point-to-point messages count too, as
ops "send" and "recv" with algorithm "p2p" (torch's own send/recv, whatever --collective says).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from dtjob.trainer.metrics import TrainerMetrics
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.timing import Interval

# Comm method -> (op label, index of the argument whose bytes are the payload, op name in
# dtjob.trainer.collectives.last_algorithm, or None for point-to-point)
_METHODS: dict[str, tuple[str, int, str | None]] = {
    "all_reduce_sum": ("all_reduce", 0, "allreduce"),
    "reduce_scatter_sum": ("reduce_scatter", 1, "reduce_scatter"),
    "all_gather": ("all_gather", 0, "allgather"),
    "broadcast": ("broadcast", 0, "broadcast"),
    "send": ("send", 0, None),
    "recv": ("recv", 0, None),
}
_installed: list[TrainerMetrics] = []
# Completed calls whose completion event (CUDA) is not done yet: (op, algorithm, bytes, interval).
_unfinished: list[tuple[str, str, int, Interval]] = []
_MAX_UNFINISHED = 256  # beyond it the oldest is waited for (a loop that never syncs its GPU)


def _observe_finished() -> None:
    """Report every call whose interval is done, oldest first; wait for the oldest while too many."""
    while len(_unfinished) > _MAX_UNFINISHED or (_unfinished and _unfinished[0][3].done()):
        op, algorithm, nbytes, interval = _unfinished.pop(0)
        for metrics in _installed:
            metrics.observe_collective(op, algorithm, nbytes, interval.seconds())


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


def _ran(comm: Comm, handle: Any, selection_op: str | None, nbytes: int) -> str:
    """The algorithm a finished call ran: p2p, native, none, the handle's record, or the group's latest."""
    if selection_op is None:
        return "p2p"
    if comm.algorithm == "native":
        return "native"
    if comm.size == 1 or nbytes == 0:
        return "none"  # returned before any message (the group's latest would be another call's)
    recorded = getattr(handle, "algorithm", None)
    if isinstance(recorded, str):
        return recorded
    from dtjob.trainer import collectives

    return collectives.last_algorithm(selection_op, comm.group) or comm.algorithm


def _wrap(
    method: Callable[..., Any], op: str, payload_arg: int, selection_op: str | None
) -> Callable[..., Any]:
    signature = inspect.signature(method)

    @functools.wraps(method)
    def timed(self: Comm, *args: Any, **kwargs: Any) -> Any:
        payload: torch.Tensor = args[payload_arg]
        nbytes = payload.numel() * payload.element_size()
        interval = Interval(payload.device)
        handle = method(self, *args, **kwargs)

        def done() -> None:
            interval.stop()
            _unfinished.append((op, _ran(self, handle, selection_op, nbytes), nbytes, interval))
            _observe_finished()

        if not signature.bind(self, *args, **kwargs).arguments.get("async_op", False):
            done()
            return handle
        return _TimedHandle(handle, done)

    return timed


def instrument_comm(metrics: TrainerMetrics) -> None:
    """Report every `Comm` collective of this process to `metrics` (idempotent per metrics)."""
    if not _installed:
        for name, (op, payload_arg, selection_op) in _METHODS.items():
            setattr(Comm, name, _wrap(getattr(Comm, name), op, payload_arg, selection_op))
    if metrics not in _installed:
        _installed.append(metrics)
