"""Run a scenario function in N real processes joined by a gloo process group on localhost.

The processes come from a forkserver that has already imported torch and the collectives, so a
world costs a fork per rank instead of a fresh interpreter (the import alone takes seconds on a
busy 2-core machine). Each rank runs `collectives_scenarios.<name>(rank, world_size, arg)` (or,
for a name "module:function", `collectives_<module>.<function>`) and sends back its return value,
or its traceback; `run_world` returns the values in rank order.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any

_SCENARIO_MODULES = ("scenarios", "dropin", "hier")
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "dtjob.trainer.collectives",
    *(f"tests.trainer.collectives_{module}" for module in _SCENARIO_MODULES),
]
_context = mp.get_context("forkserver")
_context.set_forkserver_preload(_PRELOAD)


def _entry(
    rank: int, world_size: int, store: str, name: str, arg: Any, pg_timeout_s: float, out: Any
) -> None:
    import importlib

    import torch
    import torch.distributed as dist

    module, _, function = name.rpartition(":")
    scenarios = importlib.import_module(f"tests.trainer.collectives_{module or 'scenarios'}")

    torch.set_num_threads(1)  # N ranks share 2 cores; intra-op threads would only thrash
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = getattr(scenarios, function)(rank, world_size, arg)
        out.put((rank, "ok", value))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    out.close()
    out.join_thread()
    # Skip interpreter teardown: a peer may be dead on purpose, and gloo's destructors then
    # only add noise. Everything this rank had to say is already in the queue.
    os._exit(0)


def run_world(
    world_size: int, name: str, arg: Any = None, *, timeout_s: float = 240.0, pg_timeout_s: float = 60.0
) -> list[Any]:
    """Run scenario `name` on `world_size` ranks; returns each rank's value (None for a rank that died)."""
    with tempfile.TemporaryDirectory(prefix="dtjob-collectives-") as tmp:
        store = os.path.join(tmp, "store")
        out = _context.Queue()
        procs = [
            _context.Process(target=_entry, args=(rank, world_size, store, name, arg, pg_timeout_s, out))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < world_size:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break  # some rank died without reporting (a scenario may do that on purpose)
                try:
                    rank, status, value = out.get(timeout=0.5)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"scenario {name} on {world_size} ranks did not finish in {timeout_s:.0f}s; "
                            f"ranks that reported: {sorted(results)}"
                        ) from None
                    continue
                results[rank] = (status, value)
        finally:
            for proc in procs:
                proc.join(timeout=5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
        if errors:
            raise AssertionError(f"scenario {name} on {world_size} ranks failed:\n" + "\n".join(errors))
        return [results[r][1] if r in results else None for r in range(world_size)]
