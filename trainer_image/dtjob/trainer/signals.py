"""SIGTERM (and SIGINT) ask for a clean stop; the loop finishes its step, checkpoints, exits 75.

Installed once the process group is up; before that, the default action applies (the process
ends at once: it has trained nothing that a checkpoint would need to keep).

The handler only records the request: the loop polls it once per step and the ranks agree on it
with an all-reduce (`elastic.agree`), so all of them stop after the same step even when only one
was signalled.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from dtjob import contract

EXIT_STOPPED = contract.EXIT_STOPPED


class StopRequest:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
            print(
                f"dtjob-trainer: {self.signal_name} received; stopping after the current step",
                file=sys.stderr,
                flush=True,
            )
        self.requested = True
