"""The GPU path's figures and device choices as pure functions, on the CPU (#41): step times on the
device's timeline, FLOPs per token and the peak they are divided by, where a batch is pinned and
where a reported loss is all-reduced."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from dtjob.trainer.device import collective_device, pins
from dtjob.trainer.flops import flops_per_token, peak_flops, peak_tflops_of
from dtjob.trainer.timing import Interval, StepTimer

CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)

# --- step times ----------------------------------------------------------------------------------


def test_a_step_lasts_from_its_start_to_its_stop_not_to_the_reading() -> None:
    timer = StepTimer(CPU)
    assert timer.seconds() == 0.0  # before any step
    outer = time.perf_counter()
    timer.start()
    time.sleep(0.02)
    timer.stop()
    outer = time.perf_counter() - outer
    time.sleep(0.05)  # read later: the stop, not the reading, ends the step
    seconds = timer.seconds()
    assert 0.02 <= seconds <= outer
    timer.stop()  # idempotent until the next start
    assert timer.seconds() == seconds


def test_an_unstopped_step_ends_where_the_next_begins_and_the_newest_finished_step_counts() -> None:
    timer = StepTimer(CPU)
    timer.start()
    time.sleep(0.03)
    timer.start()  # the first step ends here, the second starts
    first = timer.seconds()
    assert first >= 0.03
    timer.stop()  # the second, short
    second = timer.seconds()
    assert second < first


def test_an_interval_has_no_length_before_its_stop() -> None:
    interval = Interval(CPU)
    assert not interval.done()
    with pytest.raises(RuntimeError, match="before stop"):
        interval.seconds()
    interval.stop()
    first = interval.seconds()
    time.sleep(0.01)
    interval.stop()  # keeps the first end
    assert interval.done() and interval.seconds() == first


# --- FLOPs and peaks -------------------------------------------------------------------------------


def test_flops_per_token_adds_the_attention_term_to_six_per_parameter() -> None:
    # GPT-3 125M's shape (12 layers, width 768, 2,048 tokens): 6N + 12 * L * s * d (PaLM, app. B).
    n = 125_000_000
    assert flops_per_token(n, layers=12, seq_len=2048, width=768) == 6 * n + 12 * 12 * 2048 * 768
    assert flops_per_token(n) == 6 * n  # not a transformer: the parameters only


@pytest.mark.parametrize(
    ("name", "precision", "tf32", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0),  # plain FP32: TF32 is off by default
        ("NVIDIA H100 80GB HBM3", "fp32", True, 494.0),
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989.0),
        ("NVIDIA H200", "fp32", False, 67.0),
        ("NVIDIA H200", "fp16", True, 989.0),
        ("NVIDIA H100 PCIe", "fp32", False, 51.0),
        ("NVIDIA H100 PCIe", "bf16", False, 756.0),
        ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
        ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0),
        ("NVIDIA GeForce GTX 1080", "bf16", False, 0.0),  # not in the table: no MFU
    ],
)
def test_the_peak_is_the_precision_the_matmuls_run_in(
    name: str, precision: str, tf32: bool, tflops: float
) -> None:
    assert peak_tflops_of(name, precision, tf32) == tflops


def test_no_peak_on_the_cpu_unless_given() -> None:
    assert peak_flops(CPU, "fp32") == 0.0
    assert peak_flops(CPU, "bf16", peak_tflops=100.0) == 100e12


def test_tf32_follows_the_flags_torch_reads() -> None:
    """Each of torch's ways to allow TF32 (legacy flag, matmul precision, torch >= 2.9's
    fp32_precision), in a fresh process: the flags are process-global and mixing them is sticky."""
    code = """
import json, torch
from dtjob.trainer.flops import tf32_matmuls
seen = [tf32_matmuls()]
torch.set_float32_matmul_precision("high"); seen.append(tf32_matmuls())
torch.set_float32_matmul_precision("highest"); seen.append(tf32_matmuls())
torch.backends.cuda.matmul.allow_tf32 = True; seen.append(tf32_matmuls())
torch.backends.cuda.matmul.allow_tf32 = False; seen.append(tf32_matmuls())
if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
    torch.backends.cuda.matmul.fp32_precision = "tf32"; seen.append(tf32_matmuls())
    torch.backends.cuda.matmul.fp32_precision = "ieee"; seen.append(tf32_matmuls())
print(json.dumps(seen))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen[:5] == [False, True, False, True, False]
    assert seen[5:] in ([], [True, False])


# --- devices -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "target", "pinned"), [(CPU, GPU, True), (GPU, GPU, False), (CPU, CPU, False)]
)
def test_only_a_host_tensor_bound_for_cuda_is_pinned(
    source: torch.device, target: torch.device, pinned: bool
) -> None:
    assert pins(source, target) is pinned


@pytest.mark.parametrize(
    ("backend", "device", "where"), [("nccl", GPU, GPU), ("gloo", GPU, CPU), ("gloo", CPU, CPU)]
)
def test_a_reported_loss_is_reduced_where_the_backend_takes_it(
    backend: str, device: torch.device, where: torch.device
) -> None:
    assert collective_device(backend, device) == where
