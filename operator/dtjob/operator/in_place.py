"""Whether a job's pods restart in place (elastic.restartInPlace), and why: one explicit rule.

Restarts in place need the trainer container to run under dtjob's agent
(`python -m dtjob.launcher -- COMMAND`), so dtjob must be in the image. The rule, first match wins:

1. restartPolicy Never: off (any failure fails the job; nothing restarts).
2. elastic.restartInPlace true or false: as written. True with no `command` in the container runs
   `python -m dtjob.trainer ARGS` under the agent: the ENTRYPOINT of dtjob's trainer image, since
   the operator cannot read an image's ENTRYPOINT (an image with another ENTRYPOINT must give its
   command).
3. Unset, and the command (with its args) is `python -m dtjob.trainer ...`: on.
4. Unset otherwise: off. With no command, the image's ENTRYPOINT runs and the operator cannot tell
   whether it is dtjob's trainer; any other command may not have dtjob in its image.

The job's condition RestartInPlace carries the decision, its reason and what to set to change it,
so that a job never loses its restarts in place without saying so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

CONDITION = "RestartInPlace"
# `python[3[.11]] [-u] -m dtjob.trainer ...`: dtjob's own trainer, which restarts in place by default.
_DTJOB_TRAINER = re.compile(r"(?:.*/)?python[\d.]*(?: -u)? -m dtjob\.trainer(?: .*)?")
# The trainer image's ENTRYPOINT (trainer_image/Dockerfile): what the agent runs when the
# container gives no command.
TRAINER_ENTRYPOINT = ("python", "-m", "dtjob.trainer")


def runs_dtjob_trainer(command: Sequence[str]) -> bool:
    """Whether a container's command (with its args) runs dtjob's trainer."""
    return _DTJOB_TRAINER.fullmatch(" ".join(str(word) for word in command)) is not None


@dataclass(frozen=True)
class InPlaceRule:
    """The decision, and the condition's reason and message that say why."""

    on: bool
    reason: str
    message: str


def decide(
    never_restarts: bool, chosen: bool | None, command: Sequence[str], args: Sequence[str]
) -> InPlaceRule:
    """The module's rule for a job whose restartPolicy is Never (`never_restarts`), whose
    elastic.restartInPlace is `chosen`, and whose trainer container has `command` and `args`."""
    if never_restarts:
        return InPlaceRule(
            False, "RestartPolicyNever", "off: restartPolicy Never fails the job on any failure"
        )
    if chosen is True:
        ran = " ".join(command) if command else " ".join(TRAINER_ENTRYPOINT) + " (no command given)"
        return InPlaceRule(
            True, "Requested", f"on: spec.elastic.restartInPlace is true; the agent runs {ran}"
        )
    if chosen is False:
        return InPlaceRule(False, "NotRequested", "off: spec.elastic.restartInPlace is false")
    if runs_dtjob_trainer([*command, *args]):
        return InPlaceRule(True, "DtjobTrainer", "on: the trainer container runs `python -m dtjob.trainer`")
    if not command:
        return InPlaceRule(
            False,
            "NoCommand",
            "off: the trainer container has no command, so the image's ENTRYPOINT runs, which the "
            "operator cannot read; set spec.elastic.restartInPlace: true when it is dtjob's trainer "
            "(`python -m dtjob.trainer`, as in dtjob's trainer image), or give the command",
        )
    return InPlaceRule(
        False,
        "OtherCommand",
        "off: the trainer container does not run `python -m dtjob.trainer`; set "
        "spec.elastic.restartInPlace: true when its image has dtjob (the agent then runs the command)",
    )
