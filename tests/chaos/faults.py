"""The chaos suite's fault injectors: each one does one kind of harm to a job running on the
devcluster, the way it happens to a real cluster, and returns what a report needs to know.

They take the e2e harness's `Operator` (tests/e2e/operator_harness.py), so the bounded suite
(tests/chaos/test_chaos.py) and the soak (`make chaos`) share them, and any e2e test may use one.

Kinds (the names the suite's table uses):
    sigkill        a worker's trainer SIGKILLed (a crash, an OOM kill)
    sigstop        a worker's trainer SIGSTOPped and never continued (a hang, a wedged GPU)
    netcut         one pod cut off the network (`dtjob devcluster net down`): processes keep running
    node           a node stopped (lease no longer renewed, its pods killed) and started again later
    operator       the operator SIGKILLed while a gang restart is under way, restarted a moment later
    ckpt-truncate  the newest checkpoint's rank file cut to half, then a worker SIGKILLed
    ckpt-bitflip   one byte of the newest checkpoint's rank file flipped, then a worker SIGKILLed
    ckpt-manifest  the newest checkpoint's manifest.json deleted, then a worker SIGKILLed
    volume-full    the job's checkpoint volume (a small tmpfs) filled up right before a checkpoint is
                   due, freed again once the job shows the refused write
    apiserver      the kube-apiserver SIGKILLed while the gang trains, started again 1-3 s later
    etcd           etcd SIGKILLed while the gang trains, started again 1-3 s later
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    devcluster_node,
    pods,
    trainer_pids,
)

KINDS = (
    "sigkill",
    "sigstop",
    "netcut",
    "node",
    "operator",
    "ckpt-truncate",
    "ckpt-bitflip",
    "ckpt-manifest",
    "volume-full",
    "apiserver",
    "etcd",
)
CHECKPOINT_KINDS = ("ckpt-truncate", "ckpt-bitflip", "ckpt-manifest")
# The control plane going away is no failure of a job: its gang trains on, nothing restarts.
CONTROL_PLANE = {"apiserver": "kube-apiserver", "etcd": "etcd"}
# Faults that must cost the job no restart: the control plane's, and a checkpoint the volume refuses.
NO_RESTART = (*CONTROL_PLANE, "volume-full")
MANIFEST = "manifest.json"  # = dtjob.trainer.checkpoint.MANIFEST (without importing torch here)
# Each chaos job's checkpoint volume: a checkpoint of the chaos model (2 layers of width 64, with
# AdamW's two moments) is about 2 MB, and a volume holds the 3 kept plus one being written; 64 MiB
# is room enough that only a fault fills it.
VOLUME_BYTES = 64 << 20
FILLER = ".chaos-filler"  # no step-* nor staging name: the trainer neither reads nor removes it


def pod_name(job: str, rank: int) -> str:
    return f"{job}-worker-{rank}"


def node_of(op: Operator, job: str, rank: int) -> str:
    for p in pods(op, job):
        if p["metadata"]["name"] == pod_name(job, rank):
            return str(p["spec"]["nodeName"])
    pytest.fail(f"{pod_name(job, rank)} not found")


def sigstop_worker(op: Operator, job: str, rank: int) -> list[int]:
    """SIGSTOP rank `rank`'s trainer processes (never continued: the operator has to replace them);
    returns their pids."""
    pids = trainer_pids(op, job, rank)
    if not pids:
        pytest.fail(f"no trainer process of {job} rank {rank} found on this machine")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def pod_network(op: Operator, pod: str, up: bool) -> None:
    """`dtjob devcluster net down|up POD`: one pod's veth down (cut off) or up again."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dtjob.cli",
            "devcluster",
            "net",
            "up" if up else "down",
            pod,
            "-n",
            op.namespace,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def stop_node(name: str) -> None:
    devcluster_node("stop", name)


def start_node(name: str) -> None:
    devcluster_node("start", name)


def restart_operator(op: Operator, down_seconds: float) -> None:
    """SIGKILL the operator, leave it down `down_seconds`, start it again."""
    op.kill()
    time.sleep(down_seconds)
    op.start()


def restart_component(component: str, down_seconds: float) -> None:
    """`dtjob devcluster restart COMPONENT --down S`: SIGKILLed, down S seconds, started again."""
    done = subprocess.run(
        [sys.executable, "-m", "dtjob.cli", "devcluster", "restart", component, f"--down={down_seconds}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def mount_volume(root: Path) -> None:
    """A tmpfs of VOLUME_BYTES at `root` (an empty directory): the job's own checkpoint volume,
    which `fill_volume` can fill without touching this machine's disk. Pods started after this see
    it (each pod's private mount namespace copies the host's mounts)."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={VOLUME_BYTES},mode=0755", "dtjob-chaos", str(root)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, f"mount a tmpfs at {root} (needs root): {done.stderr.strip()}"


def unmount_volume(root: Path) -> None:
    """Detach the tmpfs at `root` at once (lazily: a pod still running keeps its view until it
    exits)."""
    subprocess.run(["umount", "--lazy", str(root)], capture_output=True, timeout=30, check=False)


def fill_volume(root: Path) -> Path:
    """Allocate every free byte of the volume at `root` to one file (the next checkpoint write
    meets ENOSPC); returns the file, whose removal frees the volume again."""
    filler = root / FILLER
    fs = os.statvfs(root)
    free = fs.f_bavail * fs.f_frsize
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, free)
    finally:
        os.close(fd)
    return filler


def checkpoint_root(op: Operator, job: str) -> Path:
    """The host directory of the job's checkpoints (job_manifest's hostPath volume)."""
    return SCRATCH / op.namespace / job / "checkpoints"


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """(step, directory) of the newest step directory that has a manifest."""
    found = sorted(
        (int(p.name.split("-", 1)[1]), p)
        for p in root.glob("step-*")
        if p.is_dir() and p.name.split("-", 1)[1].isdigit() and (p / MANIFEST).exists()
    )
    return found[-1] if found else None


def damage_checkpoint(root: Path, how: str) -> int:
    """Damage the newest complete checkpoint under `root` (how: one of CHECKPOINT_KINDS); returns
    its step. Only safe while no rank writes one (the gang held at its step gate)."""
    newest = newest_checkpoint(root)
    if newest is None:
        pytest.fail(f"no complete checkpoint under {root} to damage")
    step, directory = newest
    rank_file = directory / "rank-00000.pt"
    if how == "ckpt-truncate":
        size = rank_file.stat().st_size
        with rank_file.open("r+b") as f:
            f.truncate(size // 2)
    elif how == "ckpt-bitflip":
        with rank_file.open("r+b") as f:
            f.seek(rank_file.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
    elif how == "ckpt-manifest":
        (directory / MANIFEST).unlink()
    else:
        raise ValueError(f"not a checkpoint fault: {how!r}")
    return step
