"""spec.parallelism on the devcluster (#44): a job of `parallelism: {tensor: 2}`, 2 pods x 2
processes (each pod one tensor-parallel pair, the two pods data parallel), trains the built-in
GPT without a --tensor-parallel flag (the operator's DTJOB_PARALLELISM_TENSOR sets it), to the
losses of one process; it survives a SIGKILLed trainer process (restarted in place) and a
`kubectl scale` to 1 pod (tensor parallel 2 x data parallel 1), and completes every step.

Step gates (DTJOB_STEP_GATE) hold the trainers at the steps the test chooses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Devcluster, kubectl, wait_for
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
from tests.e2e.test_multiprocess_pods import STEPS, reference_losses

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAME = "tp2"


@pytest.fixture(scope="module")
def op(devcluster: Devcluster) -> Iterator[Operator]:
    yield from operator_namespace("op-tp")


def test_tensor_parallel_job_survives_a_kill_and_a_rescale_of_data_parallel(op: Operator) -> None:
    flags = ["--strategy=ddp", "--collective=auto"]
    want = reference_losses(flags)
    gate = SCRATCH / op.namespace / f"{NAME}.gate"
    gate.parent.mkdir(parents=True, exist_ok=True)
    gate.write_text("5")
    manifest = job_manifest(
        op, NAME, replicas=2, min_replicas=1, max_replicas=2, steps=STEPS, checkpoint_every=4
    )
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer["command"] = [*trainer["command"], *flags]
    trainer["env"] = [{"name": "DTJOB_STEP_GATE", "value": str(gate)}]
    manifest["spec"].update(nprocPerWorker=2, parallelism={"tensor": 2})
    apply(manifest)

    def check_losses() -> None:
        for r in step_log(op, NAME):
            assert r["loss"] == pytest.approx(want[r["step"] - 1], rel=1e-5), (
                f"step {r['step']} at world {r['world_size']}, generation {r['generation']}"
            )

    wait_step(op, NAME, 5, timeout=300)
    wait_status(op, NAME, "4 processes", lambda s: s.get("worldSize") == 4 and s.get("replicas") == 2)
    assert {(r["world_size"], r["tensor_parallel"], r["data_parallel"]) for r in step_log(op, NAME)} == {
        (4, 2, 2)
    }
    check_losses()

    # Unplanned: rank 1 (pod 0's second process, rank 0's TP partner) killed; pod 0's agent
    # restarts the gang in place, which resumes at TP 2 x DP 2.
    sigkill_worker(op, NAME, rank=1)
    gate.write_text("8")
    again = lambda: any(r.get("in_place_restarts") == 1 for r in step_log(op, NAME))  # noqa: E731
    wait_for("a step of the gang restarted in place", again, timeout=300)
    wait_step(op, NAME, 8, timeout=300)
    wait_status(op, NAME, "a counted restart", lambda s: (s.get("restarts") or 0) == 1, timeout=120)
    check_losses()

    # Planned: kubectl scale to 1 pod changes the data-parallel size only: TP 2 x DP 1.
    kubectl("scale", f"dtj/{NAME}", "-n", op.namespace, "--replicas=1", check=True)
    one_pod = lambda s: s.get("worldSize") == 2 and s.get("phase") == "Running"  # noqa: E731
    wait_status(op, NAME, "1 pod of 2 processes", one_pod, timeout=300)
    gate.write_text(str(STEPS))
    st = wait_phase(op, NAME, "Succeeded", timeout=300)
    assert st["step"] == STEPS
    log = step_log(op, NAME)
    assert log[-1]["step"] == STEPS and sorted({r["step"] for r in log}) == list(range(1, STEPS + 1))
    after = {(r["world_size"], r["tensor_parallel"], r["data_parallel"]) for r in log if r["generation"] >= 1}
    assert after == {(2, 2, 1)}, "after the scale: one pod, one TP pair, data parallel 1"
    check_losses()
    rank0 = kubectl("logs", f"{NAME}-worker-0", "-n", op.namespace, check=True).stdout
    assert "parallelism: tensor parallel 2 x pipeline 1 x data parallel 1 (world 2" in rank0, rank0[-2000:]
