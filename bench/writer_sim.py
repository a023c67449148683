"""The operator's writer (dtjob.operator.writer) against a simulated API server, without a cluster:
N new jobs of 4 workers handed over at once, while started jobs' status patches come at 20 a
second, with and without the admission of new jobs (`JobWriter.admit`, as the pass runner asks).

    python bench/writer_sim.py --jobs 500 2000

The API server is a semaphore of `--api-slots` requests at once, each taking `--api-seconds`
(8 x 50 ms: 160 requests a second, about what KWOK's devcluster answered the operator's pod
writes at 500 jobs). Printed per run: when the last job's writes were answered, and the p50/p99
of each write's time from its hand-over to its answer (what dtjob_operator_write_duration_seconds
holds). Not a measurement of a cluster: of the writer's queueing alone.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dtjob.operator.actions import Action, CreatePod, PatchStatus
from dtjob.operator.writer import JobWriter

WORKERS = 4
STARTED_PATCHES = 100  # a started job's status patch every 50 ms, while the new jobs come


def job(name: str, started: bool) -> dict[str, Any]:
    status = {"phase": "Running", "generation": 0} if started else {}
    return {"metadata": {"name": name, "namespace": "sim", "uid": name}, "spec": {}, "status": status}


def pod(job_name: str, rank: int) -> CreatePod:
    return CreatePod({"metadata": {"name": f"{job_name}-worker-{rank}", "namespace": "sim"}})


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, int(q * len(ordered) + 0.5) - 1)]


def run(jobs: int, admission: bool, slots: int, seconds: float) -> dict[str, Any]:
    api = threading.Semaphore(slots)

    def call(*_: Any) -> None:
        with api:
            time.sleep(seconds)

    latencies: dict[str, list[float]] = defaultdict(list)
    writer = JobWriter(call, call, call, 16, 32, observe=lambda kind, s: latencies[kind].append(s))
    passes = ThreadPoolExecutor(16)
    done = threading.Semaphore(0)

    def first_pass(name: str) -> None:
        retry: Callable[[], object] = lambda: passes.submit(first_pass, name)  # noqa: E731
        if admission and not writer.admit(("sim", name), retry):
            return
        actions: list[Action] = [PatchStatus({"phase": "Pending"}), *(pod(name, r) for r in range(WORKERS))]
        writer.submit(job(name, False), actions, lambda e: None, lambda e: done.release())

    start = time.monotonic()
    for i in range(jobs):
        passes.submit(first_pass, f"job-{i}")
    for i in range(STARTED_PATCHES):
        time.sleep(0.05)
        writer.submit(
            job(f"started-{i}", True), [PatchStatus({"phase": "Running"})], lambda e: None, lambda e: None
        )
    for _ in range(jobs):
        if not done.acquire(timeout=120):
            raise SystemExit("stalled: a job's writes were not answered in 120 s")
    out: dict[str, Any] = {
        "jobs": jobs,
        "admission": admission,
        "all_done_s": round(time.monotonic() - start, 1),
    }
    for kind, values in sorted(latencies.items()):
        out[kind] = {
            "n": len(values),
            "p50_s": round(quantile(values, 0.5), 2),
            "p99_s": round(quantile(values, 0.99), 2),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, nargs="+", default=[500])
    parser.add_argument("--api-slots", type=int, default=8)
    parser.add_argument("--api-seconds", type=float, default=0.05)
    args = parser.parse_args()
    for jobs in args.jobs:
        for admission in (False, True):
            print(run(jobs, admission, args.api_slots, args.api_seconds), flush=True)


if __name__ == "__main__":
    main()
