"""The GPU check (`make gpu-check`): dtjob's trainer on one CUDA device, against the CPU and torch.

    python bench/gpu_check.py [--quick]

On one GPU (world size 1, the NCCL backend, as a worker pod with one GPU runs):
1. correctness: the demo's GPT (2 blocks, width 64) trained 20 steps by every wrapper (DDP, ZeRO
   1/2/3, the pipeline at one stage) in fp32 gives the CPU's losses (1e-4 relative: GPU kernels sum
   in another order), and 100 steps in bf16 stay within 2% of fp32;
2. speed and memory: a GPT of about 125M parameters (18 blocks, width 768, 1024 tokens) in bf16,
   dtjob's data_parallel against torch's DistributedDataParallel and dtjob's fully_shard (ZeRO-3)
   against torch's FSDP2 fully_shard, in the same run: samples/s (median of 5 timed runs of 5
   steps), peak GPU memory, and model FLOPs utilisation (6 x parameters x tokens/s over the
   device's peak, dtjob.trainer.flops).
Prints a table and writes bench/results/gpu_check.json. There is no GPU on CI: this runs where one
is lent, and exits 2 with one line where CUDA is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtjob.trainer.flops import flops_per_token, peak_flops
from dtjob.trainer.models import GPT, GPTConfig
from dtjob.trainer.parallel import data_parallel, fully_shard, pipeline
from dtjob.trainer.parallel.fsdp import auto_units

RESULTS = Path(__file__).resolve().parent / "results"
DEMO = {"vocab": 256, "width": 64, "depth": 2, "heads": 4, "seq_len": 64}
BIG = {"vocab": 256, "width": 768, "depth": 18, "heads": 12, "seq_len": 1024}
WRAPPERS = ("ddp", "zero1", "zero2", "zero3", "pipeline")


def _model(cfg: dict[str, int], device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg)).to(device)


def _batch(
    step: int, rows: int, cfg: dict[str, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg["vocab"], (rows, cfg["seq_len"] + 1), generator=g).pin_memory()
    tokens = tokens.to(device, non_blocking=True) if device.type == "cuda" else tokens
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _wrap(kind: str, model: nn.Module, precision: str | None) -> Any:
    if kind == "ddp":
        return data_parallel(model, mixed_precision=precision)
    if kind == "pipeline":
        return pipeline(model, stages=1, microbatches=2, loss_fn=_loss, mixed_precision=precision)
    return fully_shard(model, zero_stage=int(kind[-1]), mixed_precision=precision)


def _train(
    kind: str, cfg: dict[str, int], device: torch.device, steps: int, precision: str | None
) -> list[float]:
    """Losses of `steps` steps of the user's loop; kind "plain": the unwrapped model (fp32)."""
    model = _model(cfg, device)
    wrapped: Any = model if kind == "plain" else _wrap(kind, model, precision)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
    losses: list[torch.Tensor] = []
    for step in range(steps):
        x, y = _batch(step, 16, cfg, device)
        if kind == "pipeline":
            losses.append(torch.tensor(wrapped.step(x, y)))
        else:
            loss = _loss(wrapped(x), y)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return [float(v) for v in torch.stack(losses).cpu()]


def _throughput(side: str, kind: str, device: torch.device, runs: int, steps: int) -> dict[str, Any]:
    """samples/s (median of `runs`), peak memory and MFU of one side on the 125M GPT in bf16."""
    model = _model(BIG, device)
    n_params = sum(p.numel() for p in model.parameters())
    if side == "dtjob":
        wrapped: nn.Module = data_parallel(model) if kind == "ddp" else fully_shard(model)
    elif kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        for unit in auto_units(model):
            torch_fully_shard(unit)
        torch_fully_shard(model)
        wrapped = model
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=True)
    rows = 8

    def step(s: int) -> None:
        x, y = _batch(s, rows, BIG, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = _loss(wrapped(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for s in range(3):  # warm-up: allocator, lazy optimizer state, cuBLAS plans
        step(s)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    rates = []
    for r in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for s in range(steps):
            step(100 + r * steps + s)
        torch.cuda.synchronize()
        rates.append(rows * steps / (time.perf_counter() - start))
    samples_per_s = statistics.median(rates)
    peak = peak_flops(device, "bf16")
    tokens_per_s = samples_per_s * BIG["seq_len"]
    return {
        "samples_per_s": samples_per_s,
        "samples_per_s_runs": rates,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "mfu": flops_per_token(n_params) * tokens_per_s / peak if peak else None,
        "parameters": n_params,
    }


def _compare(name: str, got: list[float], want: list[float], rel: float) -> dict[str, Any]:
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    return {"check": name, "worst_relative": worst, "tolerance": rel, "ok": worst <= rel}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer timed runs (3 of 3 steps)")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_check.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "checks": [],
        "throughput": {},
    }
    cpu = torch.device("cpu")
    reference = _train("plain", DEMO, cpu, 20, None)
    fp32_100 = _train("plain", DEMO, device, 100, None)
    for kind in WRAPPERS:
        report["checks"].append(
            _compare(
                f"{kind} fp32 GPU vs CPU, 20 steps", _train(kind, DEMO, device, 20, None), reference, 1e-4
            )
        )
        bf16 = _train(kind, DEMO, device, 100, "bf16")
        report["checks"].append(_compare(f"{kind} bf16 vs fp32, 100 steps", bf16, fp32_100, 0.02))
    runs, steps = (3, 3) if args.quick else (5, 5)
    for kind in ("ddp", "zero3"):
        for side in ("dtjob", "torch"):
            report["throughput"][f"{side} {kind}"] = _throughput(side, kind, device, runs, steps)
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['device']}, torch {report['torch']}")
    for c in report["checks"]:
        mark = "ok " if c["ok"] else "BAD"
        print(f"  {mark} {c['check']:<36} worst {c['worst_relative']:.2e} (<= {c['tolerance']:g})")
    print(f"  {'125M GPT, bf16, 8 x 1024 tokens':<36} {'samples/s':>10} {'peak GiB':>9} {'MFU':>6}")
    for name, t in report["throughput"].items():
        mfu = f"{t['mfu']:.3f}" if t["mfu"] is not None else "n/a"
        print(f"  {name:<36} {t['samples_per_s']:10.2f} {t['peak_memory_gib']:9.2f} {mfu:>6}")
    for kind, peer in (("ddp", "DDP"), ("zero3", "FSDP2")):
        ratio = (
            report["throughput"][f"dtjob {kind}"]["samples_per_s"]
            / report["throughput"][f"torch {kind}"]["samples_per_s"]
        )
        print(f"  dtjob {kind} / torch {peer}: {ratio:.3f}")
    dist.destroy_process_group()
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
