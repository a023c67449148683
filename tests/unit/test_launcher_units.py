"""The launcher's pure parts: the coordinator's decision, what a standby can run, the settings."""

from __future__ import annotations

import pytest

from dtjob import contract
from dtjob.launcher.agent import AgentSettings
from dtjob.launcher.coordinator import (
    BEAT_TIMEOUT_SECONDS,
    GangState,
    Ignore,
    NoRestart,
    Restart,
    TrainerExit,
    decide,
)
from dtjob.launcher.standby import PRELOAD, PythonCommand, parse, preload_modules

NOW = 1000.0


def _state(**kw: object) -> GangState:
    state = GangState(pods=3, restarts_left=2)
    state.beats = {0: NOW, 1: NOW - 1, 2: NOW - 2}
    for k, v in kw.items():
        setattr(state, k, v)
    return state


def test_a_failure_restarts_in_place_when_every_pod_beats_and_restarts_are_left() -> None:
    assert decide(_state(), TrainerExit(pod=1, round=0, rank=5, code=137), NOW) == Restart(
        "rank 5 (pod 1) exited 137 (SIGKILL)"
    )


def test_failures_of_another_round_or_during_a_restart_are_ignored() -> None:
    assert decide(_state(round=1), TrainerExit(1, 0, 1, 1), NOW) == Ignore()
    assert decide(_state(restarting=True), TrainerExit(1, 0, 1, 1), NOW) == Ignore()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"round": 2}, "no restarts left (2 in place; elastic.maxRestarts)"),
        ({"terminating": {2}}, "pod 2 is being deleted"),
        ({"given_up": True}, "an earlier restart in place failed"),
    ],
)
def test_no_restart_in_place_when_it_cannot_help(change: dict[str, object], reason: str) -> None:
    state = _state(**change)
    assert decide(state, TrainerExit(1, state.round, 1, 1), NOW) == NoRestart(reason)


def test_a_pod_whose_agent_went_silent_or_never_came_stops_restarts_in_place() -> None:
    silent = _state()
    silent.beats[2] = NOW - BEAT_TIMEOUT_SECONDS - 0.1
    assert decide(silent, TrainerExit(0, 0, 0, 1), NOW) == NoRestart("the agent of pod 2 is not answering")
    missing = _state()
    del missing.beats[1]
    assert decide(missing, TrainerExit(0, 0, 0, 1), NOW) == NoRestart("the agent of pod 1 is not answering")


@pytest.mark.parametrize(
    ("command", "target"),
    [
        (["python", "-m", "dtjob.trainer", "--x"], PythonCommand("python", "dtjob.trainer", None, ("--x",))),
        (
            ["/v/bin/python3.11", "-u", "train.py", "a"],
            PythonCommand("/v/bin/python3.11", None, "train.py", ("a",), True),
        ),
        (["python", "-X", "dev", "train.py"], None),  # other interpreter options: cold
        (["torchrun", "train.py"], None),
        (["python"], None),
        (["python", "-m"], None),
    ],
)
def test_a_standby_runs_plain_python_commands_only(command: list[str], target: PythonCommand | None) -> None:
    assert parse(command) == target


def test_preload_is_torch_and_dynamo_unless_the_environment_names_others() -> None:
    assert preload_modules({}) == PRELOAD == ("torch", "torch._dynamo")
    assert preload_modules({"DTJOB_PRELOAD": "torch, transformers ,"}) == ("torch", "transformers")
    assert preload_modules({"DTJOB_PRELOAD": ""}) == ()


def test_agent_settings_come_from_the_operators_environment() -> None:
    env = {
        contract.ENV_LOCAL_WORLD_SIZE: "4",
        contract.ENV_POD_RANK: "2",
        contract.ENV_PODS: "3",
        contract.ENV_MASTER_ADDR: "job-worker-0.job.ns.svc",
        contract.ENV_AGENT_PORT: "29501",
        contract.ENV_RESTARTS_LEFT: "2",
        contract.ENV_PERMANENT_EXIT_CODES: "2,126,127",
    }
    s = AgentSettings.from_env(env)
    assert (s.nproc, s.pod, s.pods, s.agent_port, s.restarts_left) == (4, 2, 3, 29501, 2)
    assert s.permanent_codes == {2, 126, 127}
    plain = AgentSettings.from_env({contract.ENV_RANK: "3", contract.ENV_WORLD_SIZE: "4"})
    assert (plain.nproc, plain.pod, plain.pods, plain.agent_port, plain.restarts_left) == (1, 3, 4, None, 0)
    with pytest.raises(ValueError, match="DTJOB_PERMANENT_EXIT_CODES='2,x' is not a comma list"):
        AgentSettings.from_env({contract.ENV_PERMANENT_EXIT_CODES: "2,x"})
