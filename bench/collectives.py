"""Benchmark dtjob's collectives (ring, hd, direct, auto) against torch's native gloo collectives.

    python bench/collectives.py                     # world sizes 2, 4, 8; 1 KiB .. 64 MiB
    python bench/collectives.py --quick             # world size 4 only, fewer repetitions
    python bench/collectives.py --impls native direct --ops allreduce   # just these
    python bench/collectives.py --world-sizes 4 --min-bytes 4096 --repeats 3   # auto's picks

Prints an nccl-tests style table per op and world size (bytes, count, dtype, time, algbw, busbw),
then auto's picks (the algorithm auto settled on, native among its candidates, per op and size,
in each repeat), and writes bench/results/collectives.json and bench/results/collectives.png
(busbw against size). busbw follows nccl-tests: all-reduce algbw * 2(n-1)/n, reduce-scatter and
all-gather algbw * (n-1)/n, broadcast algbw, with bytes = the whole vector (n x the per-rank
slice for reduce-scatter and all-gather).

Every number is a median: each (op, size) is timed `--runs` times, the implementations
interleaved within each run in a balanced order so that the machine's load drifts over all of
them alike. auto is timed after its trials (tuning.py) have settled: its warm-up makes enough
calls for them. `--repeats` runs everything again in fresh processes (a new calibration and new
trials each time) and reports the medians over the repeats. How to read the numbers on a shared
VM, and the measurements behind the collectives' design: bench/README.md.
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

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
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
    for an even one."""
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
    if op == "broadcast":
        return 1.0
    return 2 * (n - 1) / n if op == "allreduce" else (n - 1) / n


def _runs_op(impl: str, op: str) -> bool:
    """Whether `impl` has an algorithm for `op` (direct has no broadcast)."""
    return not (impl == "direct" and op == "broadcast")


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
        elif op == "allgather":
            dist.all_gather_into_tensor(big, small)
        else:
            dist.broadcast(buf, 0)
    elif op == "allreduce":
        C.all_reduce(buf, algorithm=impl)
    elif op == "reduce_scatter":
        C.reduce_scatter_tensor(small, big, algorithm=impl)
    elif op == "allgather":
        C.all_gather_into_tensor(big, small, algorithm=impl)
    else:
        C.broadcast(buf, 0, algorithm=impl)


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
            whole = op in ("allreduce", "broadcast")  # one vector, not n slices
            total = count if whole else per_rank * n
            buf = torch.ones(count if whole else 0, dtype=dtype)
            big = torch.ones(0 if whole else total, dtype=dtype)
            small = torch.ones(0 if whole else per_rank, dtype=dtype)
            impls = [impl for impl in config["impls"] if _runs_op(impl, op)]

            iters = _iterations(nbytes)
            chosen = None
            times: dict[str, list[float]] = {impl: [] for impl in impls}
            cpu_times: dict[str, list[float]] = {impl: [] for impl in impls}
            for impl in impls:
                # One warm-up call each; auto calls on until it has calibrated and its trials
                # of every candidate have agreed (tuning.py) - the same call on every rank - so
                # the table shows what it settled on, as nccl-tests' warm-up iterations keep
                # start-up out of its numbers.
                _call(impl, op, buf, big, small)
                vector_bytes = total * esize
                while impl == "auto" and not _auto_settled(op, vector_bytes):
                    _call(impl, op, buf, big, small)
            for run in range(config["runs"]):
                # A different order every run, the same on every rank (balanced_orders): a
                # sample's time depends on what ran just before it (bench/README.md).
                for impl in orders[run % len(orders)]:
                    if impl not in times:
                        continue
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


def picks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op, world size and size: what auto kept in each repeat, and auto/native busbw (the
    paired median of each repeat; the median and range over the repeats)."""
    table = []
    repeats = sorted({r.get("repeat", 0) for r in rows})
    per_repeat = {k: summarize([r for r in rows if r.get("repeat", 0) == k]) for k in repeats}
    keys = sorted({(r["op"], r["world_size"], r["bytes"]) for r in rows if r["impl"] == "auto"})
    for op, n, size in sorted(keys, key=lambda k: (OPS.index(k[0]), k[1], k[2])):
        here = (op, n, size, "auto")
        kept = [
            r["auto_chose"]
            for k in repeats
            for r in rows
            if (r["op"], r["world_size"], r["bytes"], r["impl"]) == here and r.get("repeat", 0) == k
        ]
        ratios = [
            per_repeat[k][f"{op}/world{n}"]["auto_over_native_busbw"].get(str(size))
            for k in repeats
            if f"{op}/world{n}" in per_repeat[k]
        ]
        found = [r for r in ratios if r is not None]
        table.append(
            {
                "op": op,
                "world_size": n,
                "bytes": size,
                "picks": kept,
                "auto_over_native": round(statistics.median(found), 3) if found else None,
                "range": [min(found), max(found)] if found else None,
            }
        )
    return table


def print_picks(table: list[dict[str, Any]]) -> None:
    print("\n# auto's picks (native among its candidates) and auto/native busbw, over the repeats")
    print("| op | ranks | bytes | picks | auto/native median | range |")
    print("|---|---|---|---|---|---|")
    for row in table:
        spread = "" if row["range"] is None else f"{row['range'][0]:.2f}-{row['range'][1]:.2f}"
        ratio = "" if row["auto_over_native"] is None else f"{row['auto_over_native']:.2f}"
        picked = ", ".join(str(p) for p in row["picks"])
        size = _human(row["bytes"])
        print(f"| {row['op']} | {row['world_size']} | {size} | {picked} | {ratio} | {spread} |")


def _human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


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
    parser.add_argument(
        "--repeats", type=int, default=1, help="run everything this many times in fresh processes"
    )
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
    for repeat in range(args.repeats):
        fresh: list[dict[str, Any]] = []
        for n in args.world_sizes:
            fresh += run_world(n, config)
        for row in fresh:
            row["repeat"] = repeat
        print(f"\n## repeat {repeat + 1} of {args.repeats}")
        print_table(fresh)
        rows += fresh
    summary = summarize([r for r in rows if r["repeat"] == 0])
    print("\n# auto / native busbw, and where the ring overtakes hd (first repeat)")
    for key, value in summary.items():
        print(f"{key}: {json.dumps(value)}")
    auto_picks = picks(rows)
    print_picks(auto_picks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": {**config, "world_sizes": args.world_sizes},
        "seconds": round(time.time() - started, 1),
        "load_average": os.getloadavg(),
        # What produced the numbers: native's own speed changes with torch's gloo and the machine.
        "machine": machine,
        "summary": summary,
        "picks": auto_picks,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot([r for r in rows if r["repeat"] == 0], args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')} in {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
