"""dtjob against Kubeflow's PyTorchJob on the same devcluster, same trainer, same faults.

    python -m bench.peers run [--repeats 1] [--scenarios sigkill,sigstop,...] [--operators dtjob,pytorchjob]
                              [--parts DIR] [--down]
    python -m bench.peers report [--parts DIR]      # merge every run -> bench/results/peers.{json,png}

`run` builds the training-operator (cached), brings the devcluster up (3 nodes), installs both
operators as host processes (one namespace each) and runs `--repeats` jobs of each kind, in turn
(dtjob first in even repeats, the PyTorchJob first in odd ones, so load drifts hit both), writing
one part file per run to DIR (default /var/tmp/dtjob-bench-peers/parts) after every repeat. Several
runs (say, one per locked slot on a shared machine) add up; `report` takes the medians and ranges
of all of them. See bench/README.md ("dtjob and PyTorchJob").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.peers import report
from bench.peers.jobs import SCRATCH, BenchJob
from bench.peers.kube import BenchError, kubectl, machine_load
from bench.peers.operators import (
    DtjobOperator,
    HostOperator,
    TrainingOperator,
    build_training_operator,
    install_dtjob_crd,
    install_training_operator,
    training_operator_version,
    webhook_says,
)
from bench.peers.scenarios import SCENARIOS, TOTAL_STEPS, run_repeat

from dtjob.devcluster.host import free_port

DEFAULT_PARTS = Path(os.environ.get("DTJOB_BENCH_PEERS_PARTS", "/var/tmp/dtjob-bench-peers/parts"))
NAMESPACES = {"dtjob": "bench-dtjob", "pytorchjob": "bench-pytorchjob"}


def _devcluster(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "dtjob.cli", "devcluster", *args], check=False)
    if result.returncode != 0:
        raise SystemExit(f"dtjob devcluster {' '.join(args)} failed with exit {result.returncode}")


def _invalid_pytorchjob(namespace: str) -> dict[str, Any]:
    """A PyTorchJob upstream's webhook refuses (its container is not named "pytorch")."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "webhook-probe", "namespace": namespace},
        "spec": {
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": 1,
                    "template": {"spec": {"containers": [{"name": "trainer", "image": "x"}]}},
                }
            }
        },
    }


def _versions() -> dict[str, str]:
    import torch

    from dtjob.devcluster.binaries import read_versions

    v = read_versions()
    return {
        "torch": str(torch.__version__),
        "kubernetes": v["KUBERNETES_VERSION"],
        "training_operator": training_operator_version(),
        "python": platform.python_version(),
    }


def run(args: argparse.Namespace) -> None:
    scenarios = tuple(s for s in args.scenarios.split(",") if s)
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {','.join(SCENARIOS)}")
    kinds = tuple(k for k in args.operators.split(",") if k)
    if not kinds or set(kinds) - set(NAMESPACES):
        raise SystemExit(f"--operators: choose from {','.join(NAMESPACES)}, not {args.operators!r}")
    run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4]
    args.parts.mkdir(parents=True, exist_ok=True)
    part_file = args.parts / f"run-{run_id}.json"
    bin_dir = build_training_operator()
    _devcluster("up", "--nodes", "3")
    install_dtjob_crd()
    webhook_port = free_port()
    scratch = SCRATCH / run_id
    kubeconfig = install_training_operator(bin_dir, webhook_port, scratch)
    for ns in NAMESPACES.values():
        kubectl("create", "namespace", ns, check=False)
    peer = TrainingOperator(
        "training-operator",
        NAMESPACES["pytorchjob"],
        scratch / "training-operator.log",
        binary=bin_dir / "training-operator",
        kubeconfig=kubeconfig,
        webhook_port=webhook_port,
    )
    ops: dict[str, HostOperator] = {
        "dtjob": DtjobOperator("dtjob operator", NAMESPACES["dtjob"], scratch / "dtjob-operator.log"),
        "pytorchjob": peer,
    }
    part: dict[str, Any] = {
        "run_id": run_id,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_start": machine_load(),
        "versions": _versions(),
        "scenarios": list(scenarios),
        "total_steps": TOTAL_STEPS,
        "operators": {},
        "repeats": [],
    }
    try:
        for kind, op in ops.items():
            op.start()
            assert op.usage is not None
            part["operators"][kind] = {
                "ready_s": round(op.ready_seconds, 2),
                "idle_rss_mib": round(op.usage.rss_bytes() / 2**20, 1),
            }
        part["webhook_refuses_invalid_job"] = webhook_says(_invalid_pytorchjob(NAMESPACES["pytorchjob"]))
        print(f"webhook: {part['webhook_refuses_invalid_job']}", flush=True)
        for r in range(args.repeats):
            order = ["dtjob", "pytorchjob"] if r % 2 == 0 else ["pytorchjob", "dtjob"]
            for kind in [k for k in order if k in kinds]:
                name = f"{'dtj' if kind == 'dtjob' else 'ptj'}-{run_id[-4:]}-{r}"
                job = BenchJob(kind, name, NAMESPACES[kind], TOTAL_STEPS)
                print(f"repeat {r}: {kind} job {name} (load {machine_load():.1f})", flush=True)
                t = time.monotonic()
                result = run_repeat(job, ops[kind], scenarios)
                result["repeat"] = r
                result["wall_s"] = round(time.monotonic() - t, 1)
                part["repeats"].append(result)
                part["load_end"] = machine_load()
                part_file.write_text(json.dumps(part, indent=1))
    except BenchError as e:
        part["error"] = str(e)
        part_file.write_text(json.dumps(part, indent=1))
        raise SystemExit(f"bench-peers: {e}") from None
    finally:
        for op in ops.values():
            op.stop()
        part_file.write_text(json.dumps(part, indent=1))
        print(f"wrote {part_file}; operator logs in {scratch}", flush=True)
        if args.down:
            _devcluster("down")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run", help="bring the devcluster up and run repeats of every scenario, both operators"
    )
    r.add_argument("--repeats", type=int, default=1)
    r.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {','.join(SCENARIOS)}"
    )
    r.add_argument(
        "--operators", default=",".join(NAMESPACES), help="comma-separated: one side alone, to look into it"
    )
    r.add_argument("--parts", type=Path, default=DEFAULT_PARTS)
    r.add_argument("--down", action="store_true", help="take the devcluster down at the end")
    p = sub.add_parser("report", help="merge the part files into bench/results/peers.{json,png}")
    p.add_argument("--parts", type=Path, default=DEFAULT_PARTS)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "peers.json")
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    else:
        report.main(args.parts, args.out)


if __name__ == "__main__":
    main()
