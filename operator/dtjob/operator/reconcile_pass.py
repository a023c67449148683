"""One reconcile pass: the job's status being built, the actions and events being collected, what
the pass waits for, and when the job needs its next pass. Every rule works on a ReconcilePass
(dtjob.operator.reconciler and its helper modules); status.phase is written by `set_phase` only."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from dtjob.api import JobPhase
from dtjob.operator.actions import Action, EmitEvent
from dtjob.operator.conditions import with_condition
from dtjob.operator.jobview import JobView
from dtjob.operator.observed import Observed
from dtjob.operator.settings import ReconcilerSettings

# The job's phases; status.phase is written by ReconcilePass.set_phase only.
PENDING, RUNNING, RESTARTING = JobPhase.PENDING, JobPhase.RUNNING, JobPhase.RESTARTING
SUCCEEDED, FAILED, SUSPENDED = JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.SUSPENDED
FINISHED = frozenset({SUCCEEDED, FAILED})


@dataclass
class ReconcilePass:
    """One reconcile pass: the status being built and the actions being collected."""

    obs: Observed
    settings: ReconcilerSettings
    job: JobView
    status: dict[str, Any]
    actions: list[Action] = field(default_factory=list)
    events: list[EmitEvent] = field(default_factory=list)
    waiting: tuple[str, str] | None = None  # (reason, message) of the Waiting condition
    wake: datetime | None = None  # see Plan.wake_at
    poll: bool = False  # see Plan.poll
    # status.silentNodes still avoided: node name -> its entry ({name, since, leaseRenewTime}),
    # see silent_nodes
    silent: dict[str, dict[str, str]] = field(default_factory=dict)
    more: bool = False  # pod creations left out beyond the pass's budget, see Plan.more

    @property
    def pod_write_budget(self) -> int:
        """Pod creations and deletions this pass may send: pod_writes_per_pass, and no more than
        twice that in flight for the job (the writes of earlier passes still unanswered)."""
        limit = self.settings.pod_writes_per_pass
        return max(0, min(limit, 2 * limit - self.obs.pod_writes_in_flight))

    @functools.cached_property
    def nodes(self) -> dict[str, Mapping[str, Any]]:
        """The observed nodes by name (a 1,024-worker pass looks up each worker's node)."""
        return {str((n.get("metadata") or {}).get("name")): n for n in self.obs.nodes}

    @property
    def now(self) -> datetime:
        return self.obs.now

    def wake_at(self, moment: datetime, strict: bool = False) -> None:
        """Time alone changes this pass's decision at `moment`, or just after it for a rule that
        compares with `>` (`strict`); ignored when that is not in the future."""
        if strict:
            moment += timedelta(microseconds=1)
        if moment > self.now and (self.wake is None or moment < self.wake):
            self.wake = moment

    def condition(self, ctype: str) -> dict[str, Any] | None:
        for cond in self.status.get("conditions") or []:
            if cond.get("type") == ctype:
                return dict(cond)
        return None

    def set_condition(self, ctype: str, value: bool | None, reason: str, message: str) -> None:
        conditions = self.status.get("conditions") or []
        self.status["conditions"] = with_condition(conditions, ctype, value, reason, message, self.now)

    def wait(self, reason: str, message: str) -> None:
        """Say what the operator waits for (condition Waiting); the first wait of a pass wins."""
        if self.waiting is None:
            self.waiting = (reason, message)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(EmitEvent("Warning" if warning else "Normal", reason, message))

    def set_phase(self, phase: JobPhase, reason: str, message: str, warning: bool = False) -> None:
        """Record a transition, the one place status.phase is written: the phase (as its plain
        string), the matching condition (Pending has none), an Event saying why."""
        previous = self.status.get("phase")
        self.status["phase"] = phase.value
        for ctype in (RUNNING, RESTARTING, SUSPENDED, SUCCEEDED, FAILED):
            if ctype == phase:
                self.set_condition(ctype.value, True, reason, message)
            elif (self.condition(ctype) or {}).get("status") == "True":
                self.set_condition(ctype.value, False, reason, message)
        if previous != phase or phase == RESTARTING:
            self.event(reason, message, warning)
