"""The GPU acceptance (`make gpu-check`, #41): dtjob's trainer on one CUDA device, against the CPU
and against torch, one table whose every row is an assertion that can fail.

    PYTHONPATH=operator:trainer_image:devcluster python3 bench/gpu_check.py [--cpu-dry-run] [--out PATH]

Needs torch only (no pip, no network, no pydantic or kopf): the sources on PYTHONPATH. Rows:
1. correctness: the demo GPT (2 blocks, width 64, 64 tokens of the built-in corpus, real text)
   trained 20 steps in fp32 by every strategy, at world 1 (NCCL, as a worker pod with one GPU) and
   world 2 (two processes sharing the GPU: NCCL refuses two ranks on one device, so gloo with
   CUDA tensors), gives the CPU's losses at the same world size within 1e-4 relative (TF32 off:
   checked). Strategies: DDP, ZeRO-1/2/3, the pipeline with GPipe and 1F1B (one stage per rank),
   DP x PP (world 2: 2 replicas of 1 stage; world 4: 2 x 2), and the hierarchical all-reduce
   (needs 2 pods of 2: world 4 with LOCAL_WORLD_SIZE=2);
2. precision: a 125M GPT (18 blocks, width 768, 1024 tokens) trained 200 steps on the built-in
   corpus with dtjob's DDP in bf16 and in fp16 (dynamic loss scaling) ends within 2 % of fp32's
   loss (mean of the last 10 steps);
3. memory: ZeRO-3's state after a step against the formula (fp32 parameter shard + AdamW's two
   moments = 12 N / W bytes, up to 16 N / W with a persistent gradient shard), its peak against
   torch FSDP2's on the same model and batch, and the allocated memory back to the baseline after
   `del` for both;
4. speed: tokens/s and MFU (dtjob.trainer.flops: 6 N + attention, over the dense bf16 peak) of the
   125M and a 350M GPT (28 blocks, width 1024) in bf16 at 1024 tokens, dtjob's data_parallel
   against torch's DDP and dtjob's fully_shard (ZeRO-3) against torch's FSDP2, in the same run on
   the same GPU: dtjob / torch >= 1.0, and MFU >= 40 % at 350M.

--cpu-dry-run runs the same logic on the CPU with tiny sizes and few steps (gloo, world 1, 2 and 4):
the "GPU" side is the CPU too, memory is not measured, and speed rows are printed without their
goal (ok "-"): tests/trainer/test_gpu_check.py runs it. Without CUDA and without --cpu-dry-run
the script exits 2 with one line. Writes the rows as JSON to --out (default
bench/results/gpu_check.json, or a temporary file in the dry run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from dtjob.trainer.data import Corpus
from dtjob.trainer.device import collective_device
from dtjob.trainer.flops import flops_per_token, peak_flops, tf32_matmuls
from dtjob.trainer.models import GPT, GPTConfig
from dtjob.trainer.parallel import data_parallel, fully_shard, pipeline
from dtjob.trainer.parallel.fsdp import auto_units
from dtjob.trainer.timing import Interval

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20
# Models (vocab: the corpus's 256 byte values).
DEMO = {"vocab": 256, "width": 64, "depth": 2, "heads": 4, "seq_len": 64}
GPT_125M = {"vocab": 256, "width": 768, "depth": 18, "heads": 12, "seq_len": 1024}
GPT_350M = {"vocab": 256, "width": 1024, "depth": 28, "heads": 16, "seq_len": 1024}
TINY = {"vocab": 256, "width": 32, "depth": 2, "heads": 2, "seq_len": 16}
# strategy -> the world sizes it runs at (hier needs two pods of two; DP x PP at world 1 is PP).
STRATEGIES = {
    "ddp": (1, 2),
    "zero1": (1, 2),
    "zero2": (1, 2),
    "zero3": (1, 2),
    "pp-gpipe": (1, 2),
    "pp-1f1b": (1, 2),
    "dp-x-pp": (2, 4),
    "hier": (4,),
}


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the GPU's, or the dry run's (tiny, few steps)."""

    device: str
    demo: dict[str, int]
    demo_steps: int
    demo_rows: int
    precision_model: dict[str, int]
    precision_label: str
    precision_steps: int
    precision_rows: int
    memory_model: dict[str, int]
    memory_rows: int
    speed_models: dict[str, dict[str, int]] = field(default_factory=dict)
    speed_rows: int = 8
    speed_runs: int = 5
    speed_steps: int = 5


GPU_PLAN = Plan(
    "cuda", DEMO, 20, 16, GPT_125M, "125M", 200, 8, GPT_125M, 8, {"125M": GPT_125M, "350M": GPT_350M}
)
DRY_PLAN = Plan("cpu", TINY, 4, 8, TINY, "tiny", 6, 4, TINY, 4, {"tiny": TINY}, 4, 1, 2)


# --- one process of a group ------------------------------------------------------------------------

_tokens: np.ndarray | None = None


def _batch(step: int, rows: int, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: `rows` windows of the built-in corpus (the Python standard
    library's sources, dtjob.trainer.data), the same on every rank and device."""
    global _tokens
    if _tokens is None:
        _tokens = Corpus.load(None).tokens
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, len(_tokens) - seq_len - 1, (rows,), generator=g).tolist()
    windows = torch.from_numpy(np.stack([_tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64))
    windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _gpt(cfg: dict[str, int], device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg)).to(device)


def _wrap(strategy: str, model: nn.Module, precision: str | None) -> Any:
    world = dist.get_world_size()
    if strategy in ("ddp", "hier"):
        return data_parallel(
            model, mixed_precision=precision, collective="hier" if strategy == "hier" else "auto"
        )
    if strategy.startswith("zero"):
        return fully_shard(model, zero_stage=int(strategy[-1]), mixed_precision=precision)
    stages = world if strategy.startswith("pp-") else world // 2
    schedule = "gpipe" if strategy == "pp-gpipe" else "1f1b"
    return pipeline(
        model, stages=stages, microbatches=4, schedule=schedule, loss_fn=_loss, mixed_precision=precision
    )


def _global_mean(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(dist.get_backend(), device))
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _train(case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Losses (global means) of the user's loop over `steps` steps of `rows`-row global batches."""
    cfg, precision = case["model"], case.get("precision")
    model = _gpt(cfg, device)
    wrapped = _wrap(case["strategy"], model, precision)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=case["lr"])
    warmup = case.get("warmup", 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (warmup + 1)))
    scaler = _scaler(case["strategy"], device, precision == "fp16")
    replicas = int(getattr(wrapped, "data_parallel_size", dist.get_world_size()))
    replica = int(getattr(wrapped, "data_parallel_rank", dist.get_rank()))
    losses = []
    for step in range(case["steps"]):
        x, y = _batch(step, case["rows"], cfg["seq_len"], device)
        share = x.shape[0] // replicas
        x, y = x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share]
        if case["strategy"].startswith(("pp-", "dp-x-pp")):
            losses.append(float(wrapped.step(x, y)))
        else:
            loss = _loss(wrapped(x), y)
            scaler.scale(loss).backward()
            losses.append(_global_mean(float(loss.detach()), device))
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {"losses": losses}


def _scaler(strategy: str, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    if strategy in ("ddp", "hier") or not enabled:
        return torch.amp.GradScaler(device.type, enabled=enabled)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type, enabled=enabled)


def _torch_wrap(kind: str, model: nn.Module, device: torch.device) -> nn.Module:
    if kind == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for unit in auto_units(model):
        torch_fully_shard(unit)
    torch_fully_shard(model)
    return model


def _memory(case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """ZeRO-3 (dtjob) or FSDP2 (torch): allocated bytes after a step (the state), the peak, and what
    is left after `del`, each over the baseline before the model existed; fp32, AdamW."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device) if cuda else 0
    cfg = case["model"]
    model = _gpt(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    wrapped = fully_shard(model) if case["side"] == "dtjob" else _torch_wrap("zero3", model, device)
    del model
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    for step in range(3):
        x, y = _batch(step, case["rows"], cfg["seq_len"], device)
        _loss(wrapped(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del x, y
    state = torch.cuda.memory_allocated(device) - baseline if cuda else None
    peak = torch.cuda.max_memory_allocated(device) - baseline if cuda else None
    del wrapped, optimizer
    gc.collect()
    left = torch.cuda.memory_allocated(device) - baseline if cuda else None
    return {"parameters": n_params, "state": state, "peak": peak, "left": left}


def _speed(case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """tokens/s (median of `runs` timed runs of `steps` steps, on the device's timeline) and MFU
    of one side in bf16."""
    cfg, rows = case["model"], case["rows"]
    model = _gpt(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    kind, side = case["kind"], case["side"]
    if side == "dtjob":
        wrapped: nn.Module = (
            data_parallel(model, mixed_precision="bf16")
            if kind == "ddp"
            else fully_shard(model, mixed_precision="bf16")
        )
        autocast: Any = contextlib.nullcontext()  # the wrappers run the forward under autocast
    else:
        wrapped = _torch_wrap(kind, model, device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(s: int) -> None:
        x, y = _batch(s, rows, cfg["seq_len"], device)
        with autocast:
            loss = _loss(wrapped(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for s in range(3):  # warm-up: allocator, lazy optimizer state, cuBLAS plans
        step(s)
    rates = []
    for r in range(case["runs"]):
        interval = Interval(device)
        for s in range(case["steps"]):
            step(100 + r * case["steps"] + s)
        interval.stop()
        rates.append(rows * cfg["seq_len"] * case["steps"] / interval.seconds())
    tokens_per_s = statistics.median(rates)
    peak = peak_flops(device, "bf16")
    per_token = flops_per_token(n_params, cfg["depth"], cfg["seq_len"], cfg["width"])
    return {
        "parameters": n_params,
        "tokens_per_s": tokens_per_s,
        "runs": rates,
        "mfu": per_token * tokens_per_s / peak if peak else None,
    }


_RUNNERS = {"train": _train, "memory": _memory, "speed": _speed}


def _worker(
    rank: int, world: int, device_kind: str, init: str, cases: list[dict[str, Any]], out: str
) -> None:
    # The hierarchical all-reduce reads the pod layout from LOCAL_WORLD_SIZE: world 4 = 2 pods of 2.
    os.environ["LOCAL_WORLD_SIZE"] = "2" if world == 4 else str(world)
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # One GPU: NCCL takes one rank per device, so several ranks on it use gloo (CUDA tensors).
    backend = "nccl" if device.type == "cuda" and world == 1 else "gloo"
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    results = []
    for case in cases:
        try:
            results.append({"ok": True, **_RUNNERS[case["run"]](case, device)})
        except Exception:
            results.append({"ok": False, "error": traceback.format_exc(limit=6)[-3000:]})
            break  # the ranks may disagree about where they are now: the rest of the group's cases fail
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results += [{"ok": False, "error": "not run: an earlier case of its group failed"}] * (
        len(cases) - len(results)
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_group(
    world: int, device_kind: str, cases: list[dict[str, Any]], timeout: float
) -> list[dict[str, Any]]:
    """Run `cases` in a fresh group of `world` processes: per case rank 0's result (losses are
    global means), or the error of a rank that failed it."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        ctx = mp.get_context("spawn")
        init = f"file://{tmp}/init"
        procs = [
            ctx.Process(target=_worker, args=(r, world, device_kind, init, cases, tmp)) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        paths = [Path(tmp, f"rank{r}.json") for r in range(world)]
        if not all(path.exists() for path in paths):
            codes = [p.exitcode for p in procs]
            return [
                {"ok": False, "error": f"group of {world} on {device_kind} died (exit codes {codes})"}
            ] * len(cases)
        ranks = [json.loads(path.read_text()) for path in paths]
        # Rank 0's results, unless another rank failed the case: then that rank's error.
        return [next((r for r in case if not r["ok"]), case[0]) for case in zip(*ranks, strict=True)]


# --- the table ----------------------------------------------------------------------------------


def _row(check: str, value: str, goal: str, ok: bool | None, detail: str = "") -> dict[str, Any]:
    return {"check": check, "value": value, "goal": goal, "ok": ok, "detail": detail}


def _worst_relative(got: list[float], want: list[float]) -> float:
    if len(got) != len(want) or not got:
        return float("inf")
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want, strict=True))


def _tail_mean(losses: list[float], n: int = 10) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def _error(result: dict[str, Any]) -> str:
    return str(result.get("error", "")).strip().splitlines()[-1] if not result["ok"] else ""


def check(plan: Plan, dry: bool) -> list[dict[str, Any]]:
    """Every row. One group per world size and device: the CPU's runs the strategies, the
    device's the same and, at world 1, precision, memory and speed, at world 2 ZeRO-3's memory."""
    rows: list[dict[str, Any]] = []
    gpu = plan.device
    if gpu == "cuda":
        rows.append(
            _row("TF32 off for the fp32 comparisons", str(tf32_matmuls()), "False", not tf32_matmuls())
        )
    by_world: dict[int, list[str]] = {}
    for name, worlds in STRATEGIES.items():
        for w in worlds:
            by_world.setdefault(w, []).append(name)
    demo = {"run": "train", "model": plan.demo, "steps": plan.demo_steps, "rows": plan.demo_rows, "lr": 3e-3}
    train = {
        "run": "train",
        "strategy": "ddp",
        "model": plan.precision_model,
        "steps": plan.precision_steps,
        "rows": plan.precision_rows,
        "lr": 3e-4,
        "warmup": 20,
    }
    memory = {"run": "memory", "model": plan.memory_model, "rows": plan.memory_rows}
    speed_keys = [
        (size, kind, side)
        for size in plan.speed_models
        for kind in ("ddp", "zero3")
        for side in ("dtjob", "torch")
    ]
    extra: dict[int, list[dict[str, Any]]] = {
        1: [{**train, "precision": p} for p in (None, "bf16", "fp16")]
        + [{**memory, "side": side} for side in ("dtjob", "torch")]
        + [
            {
                "run": "speed",
                "model": plan.speed_models[size],
                "kind": kind,
                "side": side,
                "rows": plan.speed_rows,
                "runs": plan.speed_runs,
                "steps": plan.speed_steps,
            }
            for size, kind, side in speed_keys
        ],
        2: [{**memory, "side": "dtjob"}],
    }
    for world, names in sorted(by_world.items()):
        cases = [{**demo, "strategy": n} for n in names]
        cpu = run_group(world, "cpu", cases, timeout=240)
        dev = run_group(world, gpu, cases + extra.get(world, []), timeout=420 if world == 1 else 240)
        for name, want, got in zip(names, cpu, dev, strict=False):
            check_name = f"{name} world {world} fp32: {gpu} = cpu"
            if not (want["ok"] and got["ok"]):
                rows.append(_row(check_name, "error", "<= 1e-4", False, _error(got) or _error(want)))
                continue
            worst = _worst_relative(got["losses"], want["losses"])
            rows.append(_row(check_name, f"{worst:.1e}", "<= 1e-4", worst <= 1e-4))
        extra[world] = dev[len(names) :]
    [fp32, bf16, fp16], rest = extra[1][:3], extra[1][3:]
    for name, r in (("bf16", bf16), ("fp16", fp16)):
        check_name = f"{name} follows fp32 after {plan.precision_steps} steps ({plan.precision_label})"
        if not (r["ok"] and fp32["ok"]):
            rows.append(_row(check_name, "error", "<= 2 %", False, _error(r) or _error(fp32)))
            continue
        a, b = _tail_mean(r["losses"]), _tail_mean(fp32["losses"])
        rel = abs(a - b) / b
        rows.append(_row(check_name, f"{a:.4f} vs {b:.4f} ({rel:.3%})", "<= 2 %", rel <= 0.02))
    (mem_dtjob, mem_torch), rest = rest[:2], rest[2:]
    rows += _memory_rows(mem_dtjob, mem_torch, extra[2][0], measured=gpu == "cuda")
    rows += _speed_rows(dict(zip(speed_keys, rest, strict=True)), asserted=not dry)
    return rows


def _memory_rows(
    dtjob: dict[str, Any], torch_: dict[str, Any], world2: dict[str, Any], measured: bool
) -> list[dict[str, Any]]:
    rows = []
    for result, world in ((dtjob, 1), (world2, 2)):
        name = f"ZeRO-3 state after a step, world {world}"
        if not result["ok"]:
            rows.append(_row(name, "error", "12-16 N/W bytes", False, _error(result)))
            continue
        if not measured:
            rows.append(_row(name, "not measured on the CPU", "12-16 N/W bytes", None))
            continue
        n = result["parameters"]
        low, high = 12 * n / world, 16 * n / world
        ok = 0.98 * low <= result["state"] <= 1.02 * high + 16 * MiB
        rows.append(
            _row(name, f"{result['state'] / MiB:.0f} MiB", f"{low / MiB:.0f}-{high / MiB:.0f} MiB", ok)
        )
    both = dtjob["ok"] and torch_["ok"]
    if not both:
        rows.append(
            _row("ZeRO-3 peak / FSDP2 peak", "error", "<= 1.10", False, _error(dtjob) or _error(torch_))
        )
    elif not measured:
        rows.append(_row("ZeRO-3 peak / FSDP2 peak", "not measured on the CPU", "<= 1.10", None))
    else:
        ratio = dtjob["peak"] / torch_["peak"]
        value = f"{dtjob['peak'] / MiB:.0f} / {torch_['peak'] / MiB:.0f} MiB = {ratio:.2f}"
        rows.append(_row("ZeRO-3 peak / FSDP2 peak", value, "<= 1.10", ratio <= 1.10))
    for label, result in (("dtjob ZeRO-3", dtjob), ("torch FSDP2", torch_)):
        name = f"{label}: memory back to the baseline after del"
        if not result["ok"]:
            rows.append(_row(name, "error", "<= 1 MiB", False, _error(result)))
        elif not measured:
            rows.append(_row(name, "not measured on the CPU", "<= 1 MiB", None))
        else:
            rows.append(_row(name, f"{result['left'] / MiB:.2f} MiB", "<= 1 MiB", result["left"] <= MiB))
    return rows


def _speed_rows(results: dict[tuple[str, str, str], dict[str, Any]], asserted: bool) -> list[dict[str, Any]]:
    rows = []
    for size in dict.fromkeys(s for s, _, _ in results):
        for kind, peer in (("ddp", "torch DDP"), ("zero3", "torch FSDP2")):
            mine, theirs = results[(size, kind, "dtjob")], results[(size, kind, "torch")]
            label = "DDP" if kind == "ddp" else "ZeRO-3"
            name = f"{size} bf16 tokens/s: dtjob {label} / {peer}"
            if not (mine["ok"] and theirs["ok"]):
                rows.append(_row(name, "error", ">= 1.00", False, _error(mine) or _error(theirs)))
                continue
            ratio = mine["tokens_per_s"] / theirs["tokens_per_s"]
            value = f"{mine['tokens_per_s']:.0f} / {theirs['tokens_per_s']:.0f} = {ratio:.2f}"
            rows.append(_row(name, value, ">= 1.00", ratio >= 1.0 if asserted else None))
            for side, result in (("dtjob", mine), ("torch", theirs)):
                goal = ">= 40 %" if size == "350M" and side == "dtjob" else "-"
                mfu = result["mfu"]
                ok = None if not asserted or goal == "-" or mfu is None else mfu >= 0.40
                if asserted and goal != "-" and mfu is None:
                    ok = False  # a GPU missing from dtjob.trainer.flops' table: no MFU to check
                shown = f"{mfu:.1%}" if mfu is not None else "n/a"
                rows.append(_row(f"{size} bf16 MFU {side} {label}", shown, goal, ok))
    return rows


def _print(rows: list[dict[str, Any]], header: str) -> None:
    print(header)
    width = max(len(r["check"]) for r in rows)
    for r in rows:
        mark = {True: "ok ", False: "BAD", None: " - "}[r["ok"]]
        detail = f"  ({r['detail']})" if r["detail"] else ""
        print(f"  {mark} {r['check']:<{width}}  {r['value']:>28}  goal {r['goal']}{detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same logic on the CPU, tiny sizes")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    plan = DRY_PLAN if args.cpu_dry_run else GPU_PLAN
    started = time.perf_counter()
    rows = check(plan, dry=args.cpu_dry_run)
    device = "CPU dry run" if args.cpu_dry_run else torch.cuda.get_device_name(0)
    seconds = time.perf_counter() - started
    _print(rows, f"gpu_check: {device}, torch {torch.__version__}, {seconds:.0f} s")
    out = args.out or (
        Path(tempfile.gettempdir(), "gpu_check.json") if args.cpu_dry_run else RESULTS / "gpu_check.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"device": device, "torch": torch.__version__, "seconds": seconds, "rows": rows}
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
