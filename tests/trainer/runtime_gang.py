"""Launch real `python -m dtjob.trainer` gangs on localhost (gloo) for the runtime tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtjob import contract

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = [REPO / "operator", REPO / "trainer_image", REPO / "devcluster"]

# A GPT small enough that a 4-process gang on 2 shared cores takes well under a second per step.
TINY_GPT = ["--model", "gpt", "--layers", "2", "--dim", "32", "--heads", "2", "--seq-len", "32"]
GANG_TIMEOUT_S = 300.0  # a hang guard, generous for a loaded machine: normal runs take seconds


# Ports a test listens on come from below the kernel's ephemeral range (32768-60999 here): a port
# the kernel hands out as free may be taken by an outgoing connection's source port before the
# trainer binds it, and was, twice in an hour, with an API server under a scale benchmark beside.
LISTEN_PORTS = range(20000, 32768)


def free_port() -> int:
    """A port nothing listens on or connects from now, outside the ephemeral range."""
    for _ in range(200):
        port = random.choice(LISTEN_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LISTEN_PORTS}")


def free_port_run(count: int) -> int:
    """A port p such that p .. p + count - 1 are all free now (metrics use port + LOCAL_RANK)."""
    for _ in range(100):
        base = free_port()
        try:
            socks = []
            for offset in range(count):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {count} free ports found")


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = GANG_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def trainer_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTJOB_", "TORCHELASTIC"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, SOURCE_ROOTS), env.get("PYTHONPATH", "")])
    # Several processes share two cores: one intra-op thread each avoids oversubscription.
    env["OMP_NUM_THREADS"] = "1"
    # The resume points and redone steps these tests assert are the durable checkpoints' (the
    # fallback); in-memory snapshots are on only where a test asks (test_snapshot_in_place.py).
    env[contract.ENV_SNAPSHOT_EVERY] = "0"
    env.update(extra)
    return env


@dataclass
class Gang:
    procs: list[subprocess.Popen[bytes]]
    logs: Path
    log_file: Path

    def wait(self, timeout: float = GANG_TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"gang did not finish within {timeout}s; stderr:\n{self.stderr()}"
                ) from None
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def signal(self, rank: int, sig: signal.Signals) -> None:
        self.procs[rank].send_signal(sig)

    def kill_rank_1_after_three_steps(self, timeout: float = 90) -> int:
        """SIGKILL rank 1 once three steps are logged; rank 0's exit code (then everything ends)."""
        try:
            wait_for(lambda: len(self.steps()) >= 3, "three steps")
            self.procs[1].kill()
            return self.procs[0].wait(timeout=timeout)
        finally:
            self.kill()

    def stderr(self, rank: int | None = None) -> str:
        ranks = range(len(self.procs)) if rank is None else [rank]
        return "\n".join(f"--- rank {r}\n" + (self.logs / f"rank{r}.err").read_text() for r in ranks)

    def steps(self) -> list[dict[str, Any]]:
        if not self.log_file.exists():
            return []
        return [json.loads(line) for line in self.log_file.read_text().splitlines() if line.strip()]


def launch(
    world_size: int,
    args: list[str],
    workdir: Path,
    name: str,
    generations: list[int] | None = None,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    master_port: int | None = None,
) -> Gang:
    """Start `world_size` trainer processes; rank 0 writes its JSON lines to workdir/<name>.jsonl.

    generations: each rank's DTJOB_GENERATION (default 0 for all).
    command: what each process runs after the interpreter (default: -m dtjob.trainer); it must
        take --log-file.
    master_port: MASTER_PORT (default: a free port), e.g. of a store the test hosts.
    """
    logs = workdir / f"{name}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = workdir / f"{name}.jsonl"
    port = str(master_port or free_port())
    procs = []
    for rank in range(world_size):
        rank_env = trainer_env(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            DTJOB_GENERATION=str(generations[rank] if generations else 0),
            **(env or {}),
        )
        with (logs / f"rank{rank}.out").open("wb") as out, (logs / f"rank{rank}.err").open("wb") as err:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        *(command or ["-m", "dtjob.trainer"]),
                        *args,
                        "--log-file",
                        str(log_file),
                    ],
                    env=rank_env,
                    stdout=out,
                    stderr=err,
                    cwd=workdir,
                )
            )
    return Gang(procs, logs, log_file)


def run(
    world_size: int,
    args: list[str],
    workdir: Path,
    name: str,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    master_port: int | None = None,
) -> Gang:
    """Launch and wait; fail with every rank's stderr unless all exit 0."""
    gang = launch(world_size, args, workdir, name, env=env, command=command, master_port=master_port)
    codes = gang.wait()
    assert codes == [0] * world_size, f"exit codes {codes}\n{gang.stderr()}"
    return gang


def run_single(
    args: list[str], timeout: float = 60.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dtjob.trainer", *args],
        env=trainer_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def scrape(port: int) -> dict[str, float] | None:
    """Samples of the Prometheus page at `port` (name, with its labels if any -> value), or None
    if nothing serves there (yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None  # not serving (yet)
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def checkpoint_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))
