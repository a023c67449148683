"""Merges the part files of every `run` into bench/results/peers.json (medians, ranges and every
repeat) and peers.png, and prints the table the README quotes."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

KINDS = ("dtjob", "pytorchjob")
LABELS = {"dtjob": "dtjob", "pytorchjob": "PyTorchJob"}

# (row label, path into a repeat's result, unit); the order of the README's table.
ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("submit to first step", ("submit_to_first_step_s",), "s"),
    ("SIGKILL of a worker: training again", ("faults", "sigkill", "training_again_s"), "s"),
    ("  back at 2 workers", ("faults", "sigkill", "full_world_again_s"), "s"),
    ("  steps redone / lost", ("faults", "sigkill", "repeated"), "steps"),
    ("SIGSTOP (hung worker): training again", ("faults", "sigstop", "training_again_s"), "s"),
    ("  back at 2 workers", ("faults", "sigstop", "full_world_again_s"), "s"),
    ("  steps redone / lost", ("faults", "sigstop", "repeated"), "steps"),
    ("worker's node stopped: training again", ("faults", "node_stop", "training_again_s"), "s"),
    ("  back at 2 workers", ("faults", "node_stop", "full_world_again_s"), "s"),
    ("  steps redone / lost", ("faults", "node_stop", "repeated"), "steps"),
    ("scale 2 -> 1: training at 1", ("faults", "scale_down", "at_new_world_size_s"), "s"),
    ("  steps redone / lost", ("faults", "scale_down", "repeated"), "steps"),
    ("scale 1 -> 2: training at 2", ("faults", "scale_up", "at_new_world_size_s"), "s"),
    ("  steps redone / lost", ("faults", "scale_up", "repeated"), "steps"),
    ("pods created per job", ("pods_created",), ""),
    ("Services created per job", ("services_created",), ""),
    ("operator CPU over the run", ("operator_cpu_s",), "s"),
    ("operator peak RSS", ("operator_peak_rss_mib",), "MiB"),
    ("job wall time (75 steps, every fault)", ("run_s",), "s"),
]


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _lost_path(path: tuple[str, ...]) -> tuple[str, ...] | None:
    return (*path[:-1], "lost") if path[-1] == "repeated" else None


def summarize(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    repeats = [r for p in parts for r in p.get("repeats", [])]
    rows = []
    for label, path, unit in ROWS:
        row: dict[str, Any] = {"row": label, "unit": unit, "key": ".".join(path)}
        for kind in KINDS:
            # a repeat whose figure for this fault was found wrong (excluded_faults says why)
            mine = [
                r
                for r in repeats
                if r["operator"] == kind
                and not (path[0] == "faults" and path[1] in r.get("excluded_faults", {}))
            ]
            values = [float(v) for r in mine if (v := _get(r, path)) is not None]
            row[kind] = summarize(values)
            lost = _lost_path(path)
            if lost is not None:
                row[kind]["lost"] = summarize([float(v) for r in mine if (v := _get(r, lost)) is not None])
            row[kind]["missing"] = len(mine) - len(values)  # repeats that never got there
        rows.append(row)
    loads = [
        x for p in parts for r in p.get("repeats", []) for x in (r.get("load_start"), r.get("load_end")) if x
    ]
    return {
        "what": "dtjob vs Kubeflow's PyTorchJob (torchrun elastic): same trainer, same faults",
        "runs": [
            {
                k: p.get(k)
                for k in (
                    "run_id",
                    "started",
                    "cpus",
                    "versions",
                    "operators",
                    "webhook_refuses_invalid_job",
                    "error",
                )
            }
            for p in parts
        ],
        "repeats_per_operator": {k: sum(1 for r in repeats if r["operator"] == k) for k in KINDS},
        "errors": [
            {"operator": r["operator"], "job": r["job"], "error": r["error"]} for r in repeats if "error" in r
        ],
        "load_average_1m": summarize(loads),
        "rows": rows,
        "repeats": repeats,
    }


def _fmt(s: dict[str, Any], unit: str) -> str:
    if not s.get("n"):
        return "never (" + str(s.get("missing", 0)) + " repeats)"

    def num(x: float) -> str:
        return f"{x:.1f}" if unit in ("s", "MiB") else f"{x:g}"

    text = f"{num(s['median'])} ({num(s['min'])}-{num(s['max'])})"
    if "lost" in s and s["lost"].get("n"):
        lost = s["lost"]
        text += f" / {num(lost['median'])} ({num(lost['min'])}-{num(lost['max'])})"
    if s.get("missing"):
        text += f", {s['missing']} never"
    return text


def table(merged: dict[str, Any]) -> str:
    lines = ["| | unit | dtjob | PyTorchJob | dtjob / PyTorchJob |", "|---|---|---|---|---|"]
    for row in merged["rows"]:
        a, b = row["dtjob"], row["pytorchjob"]
        ratio = ""
        if row["unit"] == "s" and a.get("n") and b.get("n") and b["median"]:
            ratio = f"{a['median'] / b['median']:.2f}"
        lines.append(
            f"| {row['row']} | {row['unit']} | {_fmt(a, row['unit'])} | {_fmt(b, row['unit'])} | {ratio} |"
        )
    return "\n".join(lines)


def plot(merged: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r for r in merged["rows"] if r["unit"] == "s" and "job wall" not in r["row"] and "CPU" not in r["row"]
    ]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.5))
    height = 0.38
    for i, kind in enumerate(KINDS):
        ys = [n + (i - 0.5) * height for n in range(len(rows))]
        med = [r[kind].get("median", 0.0) for r in rows]
        lo = [m - r[kind].get("min", m) for m, r in zip(med, rows, strict=True)]
        hi = [r[kind].get("max", m) - m for m, r in zip(med, rows, strict=True)]
        ax.barh(ys, med, height=height, xerr=[lo, hi], capsize=3, label=LABELS[kind])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["row"].strip() for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median, bars: min-max over repeats)")
    n = merged["repeats_per_operator"]
    ax.set_title(f"dtjob vs PyTorchJob on the devcluster ({n['dtjob']} / {n['pytorchjob']} repeats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(parts_dir: Path, out: Path) -> None:
    parts = [json.loads(p.read_text()) for p in sorted(parts_dir.glob("run-*.json"))]
    if not parts:
        raise SystemExit(f"no part files in {parts_dir}; run `python -m bench.peers run` first")
    merged = merge(parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    plot(merged, out.with_suffix(".png"))
    load = merged["load_average_1m"]
    print(table(merged))
    if load.get("n"):
        print(
            f"\nload average (1 min) at the repeats' starts and ends: median {load['median']:.1f}, "
            f"{load['min']:.1f}-{load['max']:.1f}"
        )
    for e in merged["errors"]:
        print(f"error: {e['operator']} {e['job']}: {e['error']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
