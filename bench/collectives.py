"""Benchmark dtjob's collectives (ring, hd, direct, auto) against torch's native gloo collectives.

    python bench/collectives.py                     # world sizes 2, 4, 8; 1 KiB .. 64 MiB
    python bench/collectives.py --quick             # world size 4 only, fewer repetitions
    python bench/collectives.py --impls native direct --ops allreduce   # just these

Prints an nccl-tests style table per op and world size (bytes, count, dtype, time, algbw, busbw),
writes bench/results/collectives.json and bench/results/collectives.png (busbw against size).
busbw follows nccl-tests: all-reduce algbw * 2(n-1)/n, reduce-scatter and all-gather
algbw * (n-1)/n, with bytes = the whole vector (n x the per-rank slice for those two).

Every number is a median: each (op, size) is timed `--runs` times, the implementations
interleaved within each run so that the machine's load drifts over all of them alike. auto is
timed after its trials (tuning.py) have settled: its warm-up makes enough calls for them.

Reading small-message numbers on a virtual machine: a rank that waits lets its vCPU halt, and
waking a halted vCPU can take a host timer tick. On the 2-vCPU VM of bench/results, world 2, 4 KiB
all-reduce, 300 calls of dtjob's ring took p50 0.69 ms, p75 4.0 ms, p95 7.7 ms, in 4 ms steps.
With two nice-19 busy loops keeping both vCPUs awake, the same calls took p50 0.54 ms and p95
0.86 ms. Torch's own calls have a tail with another cause: p95 1.5-3.9 ms without the busy loops
and 3.6-7.4 ms with them. So world-2 results below 1 MiB mostly time the hypervisor. With 4 and
8 ranks on 2 cores the vCPUs rarely idle, and there the cost is CPU: 70-76% of it in the kernel's
loopback TCP copies.

Where a large all-reduce's CPU goes (perf record -a, 6 s of back-to-back 16 MiB calls). 4 ranks:
dtjob's ring and torch's gloo ring take the same wall time; the kernel's copies are 37% and 33% of
the samples, the reduction 12% and 10%, Python and pybind 6% and 2%. The ring's receive copies cost
1.28x native's per byte (7.1 against 9.1 GB/s): gloo moves 1 MiB segments, two in flight, the ring
whole 4 MiB chunks, but cutting those into 1-2 MiB segments left the copies as dear and added
messages. 8 ranks: the ring takes 1.15x native's time (ABBA-paired); per call Python and pybind
cost 15 ms more CPU (over all ranks), receive copies 6 ms more. A rank's thread spends most of
its time inside send (gloo writes to the socket in the caller) and the reduction, not in Python.

Ratios to native move with the machine: the same all-reduce code, 4 ranks, 16 MiB, gave auto/native
0.952 on one VM and 1.085 on the next (medians of 10 runs; native took 42-58 and 38-53 ms per
call), see bench/results/allreduce_world4_repeats.txt. So the report records torch, CPU and kernel.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer_image"))

OPS = ("allreduce", "reduce_scatter", "allgather")
IMPLS = ("native", "ring", "hd", "direct", "auto")
RATIO_SIZES = (4 << 10, 1 << 20, 16 << 20, 64 << 20)


def _cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it, with family and model (a VM's name is often the vendor's alone)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor()
    name, family, model = (fields.get(k, "?") for k in ("model name", "cpu family", "model"))
    return f"{name} (family {family}, model {model})"


def _sizes(min_bytes: int, max_bytes: int) -> list[int]:
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def balanced_orders(items: tuple[str, ...]) -> list[list[str]]:
    """Orders in which to time `items`, one per run, balanced for what ran just before (a Williams
    design): over one cycle of these orders every item comes first equally often, and right after
    each other item equally often - twice per cycle of 2n orders for an odd count n, once per n
    for an even one. (The seeded shuffles used before, the same 15 in every invocation, put the
    ring right after hd 6 times of 15 and auto right after direct 5 times but after hd once.)"""
    n = len(items)
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...: every step between neighbours differs
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + shift) % n for x in first] for shift in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[items[x] for x in row] for row in rows]


def _bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def _iterations(nbytes: int) -> int:
    """Calls per timed batch, back to back as nccl-tests times its iterations: enough that a batch
    of small calls lasts a few milliseconds, and at least 4, so that a large size's sample times a
    stream of calls (as DDP's buckets are) rather than one call that starts right after a barrier."""
    return max(4, min(50, (8 << 20) // max(nbytes, 1)))


def _auto_settled(op: str, nbytes: int) -> bool:
    """After a first auto call of this kind (an `nbytes` float32 vector): whether auto has no
    trials left to run. No trials at all means the model or DTJOB_COLLECTIVE_ALGO decided."""
    import torch.distributed as dist

    from dtjob.trainer.collectives.tuning import call_kind
    from dtjob.trainer.collectives.work import runner_for

    group = dist.group.WORLD
    assert group is not None
    trials = runner_for(group).trials.get(call_kind(op, nbytes, "float32"))
    return trials is None or trials.winner is not None


def _call(impl: str, op: str, buf: Any, big: Any, small: Any) -> None:
    import torch.distributed as dist

    from dtjob.trainer import collectives as C

    if impl == "native":
        if op == "allreduce":
            dist.all_reduce(buf)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(small, big)
        else:
            dist.all_gather_into_tensor(big, small)
    elif op == "allreduce":
        C.all_reduce(buf, algorithm=impl)
    elif op == "reduce_scatter":
        C.reduce_scatter_tensor(small, big, algorithm=impl)
    else:
        C.all_gather_into_tensor(big, small, algorithm=impl)


def _rank_main(rank: int, n: int, store: str, config: dict[str, Any], out: Any) -> None:
    import torch
    import torch.distributed as dist

    from dtjob.trainer import collectives as C

    torch.set_num_threads(1)  # n ranks share the machine's cores; gloo reduces single-threaded too
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=n, timeout=datetime.timedelta(minutes=10)
    )
    dtype = torch.float32
    esize = 4
    rows = []
    orders = balanced_orders(tuple(config["impls"]))
    for op in config["ops"]:
        for nbytes in config["sizes"]:
            count = nbytes // esize  # elements of the whole vector
            per_rank = count // n
            total = per_rank * n if op != "allreduce" else count
            buf = torch.ones(count if op == "allreduce" else 0, dtype=dtype)
            big = torch.ones(total if op != "allreduce" else 0, dtype=dtype)
            small = torch.ones(per_rank if op != "allreduce" else 0, dtype=dtype)

            iters = _iterations(nbytes)
            chosen = None
            times: dict[str, list[float]] = {impl: [] for impl in config["impls"]}
            cpu_times: dict[str, list[float]] = {impl: [] for impl in config["impls"]}
            for impl in config["impls"]:
                # One warm-up call each; auto calls on until it has calibrated and its trials
                # of every candidate have agreed (tuning.py) - the same call on every rank - so
                # the table shows what it settled on, as nccl-tests' warm-up iterations keep
                # start-up out of its numbers.
                _call(impl, op, buf, big, small)
                vector_bytes = (count if op == "allreduce" else total) * esize
                while impl == "auto" and not _auto_settled(op, vector_bytes):
                    _call(impl, op, buf, big, small)
            for run in range(config["runs"]):
                # A different order every run, the same on every rank (balanced_orders): a
                # sample's time depends on what ran just before it. Rotating one fixed order kept
                # every implementation behind the same neighbour - the ring always behind native -
                # and that neighbour's leftovers stayed in its numbers: the same ring, 4 ranks,
                # 16 MiB, 80 rounds, measured 0.977x native timed right after native and 1.001x
                # timed right after itself. One untimed call after the barrier takes most of what
                # is left of them, not all: in 20 runs of 15 samples (4 ranks, all-reduce), native
                # took 1.05x the run's median ring time at 1 MiB right after direct (20 samples)
                # and 1.16x first after the barrier (60); at 16 MiB 0.99x right after the ring
                # (100) and 1.01x right after direct (20).
                for impl in orders[run % len(orders)]:
                    dist.barrier()
                    _call(impl, op, buf, big, small)
                    start, cpu_start = time.perf_counter(), time.process_time()
                    for _ in range(iters):
                        _call(impl, op, buf, big, small)
                    elapsed = (time.perf_counter() - start) / iters
                    cpu = (time.process_time() - cpu_start) / iters
                    # The slowest rank's time is the collective's time; CPU time is summed over
                    # ranks (all threads, gloo's included): unlike wall time it hardly depends on
                    # what else the shared machine runs.
                    t = torch.tensor([elapsed], dtype=torch.float64)
                    dist.all_reduce(t, dist.ReduceOp.MAX)
                    c = torch.tensor([cpu], dtype=torch.float64)
                    dist.all_reduce(c)
                    times[impl].append(t.item())
                    cpu_times[impl].append(c.item())
                    if impl == "auto":
                        chosen = C.last_algorithm(op)
            if rank == 0:
                nb = total * esize
                for impl, samples in times.items():
                    median = statistics.median(samples)
                    algbw = nb / median / 1e9
                    rows.append(
                        {
                            "op": op,
                            "world_size": n,
                            "impl": impl,
                            "bytes": nb,
                            "count": total,
                            "dtype": "float32",
                            "time_us": median * 1e6,
                            "algbw_GBps": algbw,
                            "busbw_GBps": algbw * _bus_factor(op, n),
                            "samples_us": [s * 1e6 for s in samples],
                            "cpu_us": statistics.median(cpu_times[impl]) * 1e6,
                            "auto_chose": chosen if impl == "auto" else None,
                        }
                    )
    if rank == 0:
        model = C.calibrated_costs()
        out.put({"rows": rows, "cost_model": repr(model)})
    dist.barrier()
    dist.destroy_process_group()


def run_world(n: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dtjob-bench-") as tmp:
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_rank_main, args=(r, n, os.path.join(tmp, "store"), config, out))
            for r in range(n)
        ]
        for p in procs:
            p.start()
        report: dict[str, Any] = out.get()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a rank of the world of {n} failed: exit codes {[p.exitcode for p in procs]}")
        print(f"world {n}: calibrated {report['cost_model']}", flush=True)
        rows: list[dict[str, Any]] = report["rows"]
        for row in rows:
            row["cost_model"] = report["cost_model"]
        return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    key = None
    for row in rows:
        if (row["op"], row["world_size"]) != key:
            key = (row["op"], row["world_size"])
            print(f"\n# {row['op']}  world_size={row['world_size']}")
            header = ("impl", "bytes", "count", "dtype", "time(us)", "algbw", "busbw", "cpu(us)")
            print("{:>7} {:>10} {:>10} {:>8} {:>11} {:>8} {:>8} {:>11}  auto".format(*header))
        print(
            f"{row['impl']:>7} {row['bytes']:>10} {row['count']:>10} {row['dtype']:>8} "
            f"{row['time_us']:>11.1f} {row['algbw_GBps']:>8.3f} {row['busbw_GBps']:>8.3f} "
            f"{row['cpu_us']:>11.1f}  {row['auto_chose'] or ''}"
        )


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """auto/native busbw ratios (median over runs of the paired ratio) and the ring/hd crossover."""
    by = {(r["op"], r["world_size"], r["impl"], r["bytes"]): r for r in rows}
    summary: dict[str, Any] = {}
    for op, n in sorted({(r["op"], r["world_size"]) for r in rows}):
        sizes = sorted({r["bytes"] for r in rows if r["op"] == op and r["world_size"] == n})
        ratios = {}
        for size in sizes:
            auto, native = by.get((op, n, "auto", size)), by.get((op, n, "native", size))
            if auto and native:
                # Paired: run i timed native and auto back to back under the same load, so the
                # median of the per-run ratios cancels the load drift between runs.
                pairs = zip(native["samples_us"], auto["samples_us"], strict=True)
                ratios[size] = statistics.median(n_us / a_us for n_us, a_us in pairs)
        ring_wins = [
            s
            for s in sizes
            if (op, n, "ring", s) in by
            and (op, n, "hd", s) in by
            and by[(op, n, "ring", s)]["time_us"] < by[(op, n, "hd", s)]["time_us"]
        ]
        crossover = next((s for s in sizes if all(t in ring_wins for t in sizes if t >= s)), None)
        summary[f"{op}/world{n}"] = {
            "auto_over_native_busbw": {str(s): round(v, 3) for s, v in ratios.items()},
            "ring_faster_than_hd_from_bytes": crossover,
            "ring_faster_than_hd_at": ring_wins,
        }
    return summary


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    worlds = sorted({r["world_size"] for r in rows})
    fig, axes = plt.subplots(
        len(ops), len(worlds), figsize=(4.5 * len(worlds), 3.5 * len(ops)), squeeze=False
    )
    for i, op in enumerate(ops):
        for j, n in enumerate(worlds):
            ax = axes[i][j]
            for impl in IMPLS:
                pts = sorted(
                    (r["bytes"], r["busbw_GBps"])
                    for r in rows
                    if (r["op"], r["world_size"], r["impl"]) == (op, n, impl)
                )
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")  # small messages' busbw is 100x below large ones'
            ax.set_title(f"{op}, {n} ranks (gloo, loopback)")
            ax.set_xlabel("bytes")
            ax.set_ylabel("busbw (GB/s)")
            ax.grid(True, alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--min-bytes", type=int, default=1 << 10)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument(
        "--runs",
        type=int,
        default=5,
        help="timed repetitions per point (median reported); a multiple of 10 (of 2x the number of "
        "--impls if odd, else of it) balances which implementation each one follows",
    )
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="what to time")
    parser.add_argument("--quick", action="store_true", help="world size 4 only, 3 runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "collectives.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.runs = [4], 3
    config = {
        "ops": args.ops,
        "sizes": _sizes(args.min_bytes, args.max_bytes),
        "impls": args.impls,
        "runs": args.runs,
    }
    import torch

    machine = {
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }
    print(f"# {json.dumps(machine)}")
    started = time.time()
    rows: list[dict[str, Any]] = []
    for n in args.world_sizes:
        rows += run_world(n, config)
    print_table(rows)
    summary = summarize(rows)
    print("\n# auto / native busbw, and where the ring overtakes hd")
    for key, value in summary.items():
        print(f"{key}: {json.dumps(value)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {**config, "world_sizes": args.world_sizes},
        "seconds": round(time.time() - started, 1),
        "load_average": os.getloadavg(),
        # What produced the numbers: native's own speed changes with torch's gloo and the machine.
        "machine": machine,
        "summary": summary,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
