"""bench/gpu_check.py, the GPU acceptance (#41), as far as the CPU goes: its --cpu-dry-run runs the
same logic (every strategy at world 1, 2 and 4 in real gloo groups, precision, memory, speed) at
tiny sizes, with an import system that refuses pydantic and kopf in every process (the GPU
machine has neither); without CUDA the real run says so and exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.runtime_gang import REPO

SCRIPT = REPO / "bench" / "gpu_check.py"
# Loaded by every Python process started with this directory on PYTHONPATH (the spawned ranks too).
_SITECUSTOMIZE = """
import sys

class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "kopf"):
            raise ImportError(f"gpu_check imported {name}: the GPU machine has neither")
        return None

sys.meta_path.insert(0, _Refuse())
"""


def _env(tmp_path: Path) -> dict[str, str]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    roots = [str(hook)] + [str(REPO / d) for d in ("operator", "trainer_image", "devcluster")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(roots), "CUDA_VISIBLE_DEVICES": ""}


def test_without_cuda_the_gpu_check_exits_2_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, env=_env(tmp_path), timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "gpu_check: CUDA is not available here (torch.cuda.is_available() is False)"
    ]


@pytest.mark.slow
def test_the_cpu_dry_run_fills_every_row_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["ok"] is not False for r in rows.values()), done.stdout
    strategies = {
        1: ("ddp", "zero1", "zero2", "zero3", "pp-gpipe", "pp-1f1b"),
        2: ("ddp", "zero1", "zero2", "zero3", "pp-gpipe", "pp-1f1b", "dp-x-pp"),
        4: ("dp-x-pp", "hier"),
    }
    for world, names in strategies.items():
        for name in names:
            assert rows[f"{name} world {world} fp32: cpu = cpu"]["ok"] is True, name
    assert rows["bf16 follows fp32 after 6 steps (tiny)"]["ok"] is True
    assert rows["fp16 follows fp32 after 6 steps (tiny)"]["ok"] is True
    # Memory is CUDA's allocator's: not measured here, and no speed goal on the CPU.
    assert rows["ZeRO-3 peak / FSDP2 peak"]["ok"] is None
    speed = rows["tiny bf16 tokens/s: dtjob ZeRO-3 / torch FSDP2"]
    assert speed["ok"] is None and "=" in speed["value"]
    # The table is printed: one line per row.
    assert sum(1 for line in done.stdout.splitlines() if line.startswith("  ")) == len(rows)
