"""The entry point from outside: bad flags and environment exit 2 with one clear line, an
unreachable master too, and a short run on the built-in corpus really learns."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainer.runtime_gang import free_port, run_single, trainer_env


@pytest.mark.parametrize(
    ("args", "env", "expect"),
    [
        (["--strategy", "zero9"], {}, "--strategy: unknown value 'zero9'; choose one of ddp, fsdp, pipeline"),
        (
            ["--global-batch-size", "10"],
            {"WORLD_SIZE": "4"},
            "--global-batch-size (env DTJOB_GLOBAL_BATCH_SIZE)=10",
        ),
        (
            ["--strategy", "pipeline", "--pipeline-stages", "2"],
            {"WORLD_SIZE": "3"},
            "WORLD_SIZE=3 is not a multiple of --pipeline-stages",
        ),
        ([], {"DTJOB_STEPS": "ten"}, "environment variable DTJOB_STEPS: expected int, got 'ten'"),
        (
            ["--data", "/no/such/corpus"],
            {},
            "--data (env DTJOB_DATA) /no/such/corpus: no such file or directory",
        ),
        # After torch is imported, still one line: no CUDA on a CI machine.
        (["--device", "cuda", "--steps", "1"], {}, "--device cuda (env DTJOB_DEVICE): CUDA is not available"),
        (["--model", "no_such_module:build"], {}, "--model no_such_module:build: cannot import"),
    ],
    ids=["strategy", "batch", "pipeline-stages", "env", "data", "device", "user-model"],
)
def test_bad_flags_exit_2_with_one_line(args: list[str], env: dict[str, str], expect: str) -> None:
    import torch

    if "--device" in args and torch.cuda.is_available():
        pytest.fail("this case checks the error on a machine without CUDA; run the GPU check instead")
    done = run_single(args, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], done.stderr
    assert done.stdout == ""


def test_dtjob_train_is_the_same_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dtjob.cli", "train", "--strategy", "zero9"],
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--strategy: unknown value 'zero9'" in done.stderr


@pytest.mark.slow
def test_unreachable_master_exits_2() -> None:
    port = free_port()  # nothing listens here
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = run_single(["--rendezvous-timeout", "3"], timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"cannot reach the master at 127.0.0.1:{port} within 3s" in last, done.stderr


@pytest.mark.slow
def test_short_run_on_builtin_corpus_lowers_the_loss() -> None:
    args = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq-len", "64", "--global-batch-size", "16"]
    args += ["--steps", "120", "--lr", "1e-2", "--warmup-steps", "10", "--min-lr", "1e-3"]
    done = run_single(args, timeout=300)
    assert done.returncode == 0, done.stderr
    losses = [json.loads(line)["loss"] for line in done.stdout.splitlines()]
    assert len(losses) == 120
    start, end = losses[0], sum(losses[-10:]) / 10
    # ln(256) = 5.55 is the loss of a uniform guess over bytes; 120 steps on Python source reach
    # 2.8-3.0 at world size 1, well under 0.6 x 5.55 = 3.3.
    assert start == pytest.approx(5.55, abs=0.1)
    assert end < 0.6 * start, f"loss went from {start:.3f} to {end:.3f} only"
