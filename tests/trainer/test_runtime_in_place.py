"""A restart in place of a real gang: two `python -m dtjob.trainer` processes, each under its pod
agent (`python -m dtjob.launcher`) as the operator runs them with spec.elastic.restartInPlace. One
trainer is SIGKILLed after step 6; both restart in place from their warm standbys (which had
imported torch), resume from the step-4 checkpoint and continue the reference run's trajectory."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dtjob import contract
from tests.trainer.runtime_gang import TINY_GPT, Gang, free_port, launch, scrape, trainer_env, wait_for

pytestmark = pytest.mark.slow

# fmt: off
ARGS = [
    *TINY_GPT,
    "--global-batch-size", "8",
    "--steps", "12",
    "--lr", "3e-3",
    "--warmup-steps", "2",
    "--checkpoint-every", "4",
    "--seed", "3",
]
# fmt: on
REL_TOL = 1e-5


def _children(pid: int) -> dict[int, bytes]:
    """pid -> command line of the processes whose parent is `pid`."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(proc.name)] = cmdline
    return found


def _standbys(agent_pid: int, ready: bool) -> list[int]:
    marker = b"(ready)" if ready else b"dtjob.launcher.standby"
    return [p for p, cmd in _children(agent_pid).items() if marker in cmd]


def _trainers(agent_pid: int) -> list[int]:
    return [p for p, cmd in _children(agent_pid).items() if b"dtjob.launcher" not in cmd]


def _agents(
    tmp_path: Path,
    args: list[str],
    metrics_port: int = 0,
    pod_env: Callable[[int], dict[str, str]] | None = None,
) -> Gang:
    """Two pod agents over `python -m dtjob.trainer`; rank 0 serves its metrics at metrics_port (0:
    none); `pod_env(pod)`: more environment for that pod's agent."""
    logs = tmp_path / "in-place-logs"
    logs.mkdir()
    log_file = tmp_path / "in-place.jsonl"
    master_port, agent_port = free_port(), free_port()
    procs = []
    for pod in (0, 1):
        env = trainer_env(
            **{
                contract.ENV_RANK: str(pod),
                contract.ENV_WORLD_SIZE: "2",
                contract.ENV_MASTER_ADDR: "127.0.0.1",
                contract.ENV_MASTER_PORT: str(master_port),
                contract.ENV_AGENT_PORT: str(agent_port),
                contract.ENV_RESTARTS_LEFT: "3",
                contract.ENV_METRICS_PORT: str(metrics_port if pod == 0 else 0),
                **(pod_env(pod) if pod_env is not None else {}),
            }
        )
        command = [
            sys.executable,
            "-m",
            "dtjob.launcher",
            "--",
            sys.executable,
            "-m",
            "dtjob.trainer",
            *args,
            "--log-file",
            str(log_file),
        ]
        with (logs / f"rank{pod}.out").open("wb") as out, (logs / f"rank{pod}.err").open("wb") as err:
            procs.append(
                subprocess.Popen(
                    command, env=env, stdout=out, stderr=err, cwd=tmp_path, start_new_session=True
                )
            )
    return Gang(procs, logs, log_file)


def test_a_killed_trainer_restarts_in_place_and_continues_the_same_trajectory(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    gate.write_text("6")
    metrics_port = free_port()
    agents = _agents(
        tmp_path, [*ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"), "--step-gate", str(gate)], metrics_port
    )
    reference = launch(1, [*ARGS, "--checkpoint-dir", str(tmp_path / "ref")], tmp_path, "reference")
    try:
        wait_for(lambda: any(s["step"] == 6 for s in agents.steps()), "step 6")
        pids = [p.pid for p in agents.procs]
        wait_for(lambda: all(len(_standbys(pid, ready=True)) == 1 for pid in pids), "both standbys ready")
        standbys = {pid: _standbys(pid, ready=True)[0] for pid in pids}
        victim = _trainers(pids[1])
        assert len(victim) == 1
        killed_at = time.time()
        os.kill(victim[0], signal.SIGKILL)
        wait_for(lambda: all(_trainers(pid) == [standbys[pid]] for pid in pids), "trainers from the standbys")
        wait_for(
            lambda: (
                (scrape(metrics_port) or {}).get(
                    f'{contract.METRIC_IN_PLACE_RESTARTS}{{cause="rank 1 (pod 1) exited 137 (SIGKILL)"}}'
                )
                == 1.0
            ),
            "rank 0 reporting its restart in place",
        )
        # ... and when the agents saw the failure, for the job's downtime (a few ms after the kill)
        failed_at = (scrape(metrics_port) or {}).get(contract.METRIC_IN_PLACE_RESTART_FAILED_AT)
        assert failed_at is not None and killed_at <= failed_at <= time.time(), (killed_at, failed_at)
        gate.write_text("12")
        codes = agents.wait()
        assert codes == [0, 0], agents.stderr()
        assert reference.wait() == [0], reference.stderr()
    finally:
        for agent in agents.procs:  # with the trainers and standbys of a failed test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
        agents.kill()
        reference.kill()

    steps = [int(s["step"]) for s in agents.steps()]
    # Steps 5 and 6 again: the gang resumed from the step-4 checkpoint.
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12], steps
    said = "restart in place 1: rank 1 (pod 1) exited 137 (SIGKILL) (1 of 1 trainers from warm standbys)"
    assert said in agents.stderr(0)
    want = {int(s["step"]): float(s["loss"]) for s in reference.steps()}
    for record in agents.steps()[6:]:
        step, loss = int(record["step"]), float(record["loss"])
        assert loss == pytest.approx(want[step], rel=REL_TOL), f"step {step}"
