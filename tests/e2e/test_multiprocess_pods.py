"""Worker pods of several trainer processes (spec.nprocPerWorker, dtjob.launcher) on the
devcluster: 2 pods x 2 processes train to the losses of one process; kubectl scale to 1 pod
stops the gang after a checkpoint (exit 75) and resumes it as 1 pod x 2 processes with no step
lost; a SIGKILLed local process restarts both of the pod's processes in place (from their warm
standbys), counted, in the same pod.

Step gates (DTJOB_STEP_GATE) hold the trainers at the steps the test chooses."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from dtjob.trainer.parallel.comm import COLLECTIVES
from tests.e2e.conftest import Devcluster, kubectl, kubectl_json, wait_for
from tests.e2e.operator_harness import (
    SCRATCH,
    Operator,
    apply,
    job_manifest,
    operator_namespace,
    sigkill_worker,
    step_log,
    wait_phase,
    wait_status,
    wait_step,
)
from tests.trainer.runtime_gang import trainer_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 14
TRAINER = [
    "--model=gpt",
    "--layers=1",
    "--dim=32",
    "--heads=2",
    "--seq-len=32",
    "--global-batch-size=12",
    "--lr=3e-3",
    "--warmup-steps=2",
]  # what operator_harness.job_manifest runs


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-nproc")


def reference_losses(flags: list[str]) -> list[float]:
    """One process on this machine, same flags: the losses every world size must reproduce."""
    done = subprocess.run(
        [sys.executable, "-m", "dtjob.trainer", *TRAINER, f"--steps={STEPS}", *flags],
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line)["loss"] for line in done.stdout.splitlines()]


def submit(op: Operator, name: str, flags: list[str], gate_at: int) -> Any:
    gate = SCRATCH / op.namespace / f"{name}.gate"
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.write_text(str(gate_at))
    manifest = job_manifest(
        op, name, replicas=2, min_replicas=1, max_replicas=2, steps=STEPS, checkpoint_every=4
    )
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer["command"] = [*trainer["command"], *flags]
    trainer["env"] = [{"name": "DTJOB_STEP_GATE", "value": str(gate)}]
    manifest["spec"]["nprocPerWorker"] = 2
    apply(manifest)
    return gate


def check_losses(op: Operator, name: str, want: list[float]) -> None:
    for r in step_log(op, name):
        assert r["loss"] == pytest.approx(want[r["step"] - 1], rel=1e-5), (
            f"{name} step {r['step']} at {r['world_size']}"
        )


def test_ddp_two_pods_of_two_processes_rescale_and_recover(op: Operator) -> None:
    collective = "hier" if "hier" in COLLECTIVES else "auto"
    flags = ["--strategy=ddp", f"--collective={collective}"]
    want = reference_losses(flags)
    gate = submit(op, "ddp", flags, gate_at=5)
    wait_step(op, "ddp", 5, timeout=300)
    st = wait_status(op, "ddp", "4 processes", lambda s: s.get("worldSize") == 4)
    assert st["replicas"] == 2
    assert {r["world_size"] for r in step_log(op, "ddp")} == {4}
    check_losses(op, "ddp", want)

    # Planned: every local process checkpoints with the gang and exits 75; 1 pod x 2 resumes.
    kubectl("scale", "dtj/ddp", "-n", op.namespace, "--replicas=1", check=True)
    one_pod = lambda s: s.get("worldSize") == 2 and s.get("phase") == "Running"  # noqa: E731
    wait_status(op, "ddp", "1 pod of 2 processes", one_pod, timeout=300)
    gate.write_text("9")
    wait_step(op, "ddp", 9, timeout=300)
    log = step_log(op, "ddp")
    assert [r["step"] for r in log] == list(range(1, 10)), "no step lost or repeated"
    assert {r["world_size"] for r in log if r["generation"] == 1} == {2}
    check_losses(op, "ddp", want)
    assert (wait_status(op, "ddp", "running", lambda s: True).get("restarts") or 0) == 0

    # Unplanned: one local process killed; the pod's agent restarts both in place (their standbys).
    uid = kubectl_json("get", "pod", "ddp-worker-0", "-n", op.namespace)["metadata"]["uid"]
    sigkill_worker(op, "ddp", rank=1)
    gate.write_text("11")
    again = lambda: any(r.get("in_place_restarts") == 1 for r in step_log(op, "ddp"))  # noqa: E731
    wait_for("a step of the gang restarted in place", again, timeout=300)
    assert kubectl_json("get", "pod", "ddp-worker-0", "-n", op.namespace)["metadata"]["uid"] == uid
    wait_status(op, "ddp", "a counted restart", lambda s: (s.get("restarts") or 0) == 1, timeout=120)
    gate.write_text(str(STEPS))
    st = wait_phase(op, "ddp", "Succeeded", timeout=300)
    assert st["step"] == STEPS


def test_zero3_two_pods_of_two_processes_match_one_process(op: Operator) -> None:
    flags = ["--strategy=fsdp", "--zero-stage=3", "--collective=auto"]
    want = reference_losses(flags)
    gate = submit(op, "zero3", flags, gate_at=STEPS)
    st = wait_phase(op, "zero3", "Succeeded", timeout=300)
    assert st["step"] == STEPS and st["worldSize"] == 4
    assert {r["world_size"] for r in step_log(op, "zero3")} == {4}
    check_losses(op, "zero3", want)
    assert gate.exists()
