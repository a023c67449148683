"""The cases each spawned world runs (see _parallel_harness.py), and their cached results.

Three process groups for the whole suite: worlds of 2, 3 and 4 ranks. World 2 also writes
checkpoints that worlds 3 and 4 resume from (resharding across world sizes).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import shutil
import tempfile
from typing import Any

from tests.trainer import _parallel_harness as h


def available_algorithms() -> list[str]:
    """native always; ring/hd/auto once dtjob.trainer.collectives provides them.

    DTJOB_TEST_ALGORITHMS=native,ring narrows the set while debugging.
    """
    if os.environ.get("DTJOB_TEST_ALGORITHMS"):
        return os.environ["DTJOB_TEST_ALGORITHMS"].split(",")
    try:
        collectives = importlib.import_module("dtjob.trainer.collectives")
    except ImportError:
        return ["native"]
    needed = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast")
    if all(hasattr(collectives, f) for f in needed):
        return ["native", "ring", "hd", "auto"]
    return ["native"]


ALGORITHMS = available_algorithms()
CHECKPOINTS = tempfile.mkdtemp(prefix="dtjob-parallel-test-")
atexit.register(shutil.rmtree, CHECKPOINTS, ignore_errors=True)

# A model big enough (~110K parameters) that padding and bookkeeping are noise next to
# 16 bytes per parameter, still quick on two shared cores.
MEMORY_MODEL = {"vocab": 64, "width": 64, "depth": 2, "heads": 4, "seq_len": 16}


# The MLP with its two hidden layers sharing one weight (see _parallel_harness.build_model).
TIED = {"model": "mlp", "tie": True}


def _c(name: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "config": config}


def exact_cases(world: int) -> list[dict[str, Any]]:
    """Cases that must match single-process training to 1e-5."""
    cases = []
    for algo in ALGORITHMS:
        # Small buckets (~1 and ~4 KiB) so DDP's gradients travel in several overlapped buckets.
        cases.append(
            _c(f"ddp-{algo}", strategy="ddp", collective=algo, ddp_bucket_mb=0.004, ddp_first_bucket_mb=0.001)
        )
        for stage in (1, 2, 3):
            cases.append(_c(f"zero{stage}-{algo}", strategy="fsdp", zero_stage=stage, collective=algo))
    # When dtjob's collectives are in the set: Direct in DDP (overlapped) and ZeRO-3 (every op).
    if "auto" in ALGORITHMS:
        small_buckets = {"ddp_bucket_mb": 0.004, "ddp_first_bucket_mb": 0.001}
        cases.append(_c("ddp-direct", strategy="ddp", collective="direct", **small_buckets))
        cases.append(_c("zero3-direct", strategy="fsdp", zero_stage=3, collective="direct"))
    last = ALGORITHMS[-1]
    cases += [
        _c("ddp-clip", strategy="ddp", collective=last, grad_clip=0.05),
        _c("ddp-accum", strategy="ddp", collective=last, grad_accum=2),
        _c("zero1-accum-clip", strategy="fsdp", zero_stage=1, collective=last, grad_accum=2, grad_clip=0.05),
        _c("zero2-clip", strategy="fsdp", zero_stage=2, collective=last, grad_clip=0.05),
        _c("zero3-accum-clip", strategy="fsdp", zero_stage=3, collective=last, grad_accum=2, grad_clip=0.05),
        _c("zero3-noprefetch", strategy="fsdp", zero_stage=3, collective=last, zero3_prefetch=False),
        {**_c("ddp-ckpt", strategy="ddp", collective=last, activation_checkpointing=True), "model": "mlp"},
        {
            **_c(
                "zero3-ckpt-sgd",
                strategy="fsdp",
                zero_stage=3,
                collective=last,
                activation_checkpointing=True,
            ),
            "model": "mlp",
            "optimizer": "sgd",
        },
    ]
    # A weight shared by two blocks (the MLP's hidden layers): DDP and ZeRO-1/2 train it as one
    # parameter, ZeRO-3 keeps it in the root unit, the pipeline on both stages (gradients summed).
    cases += [
        {**_c("tied-ddp", strategy="ddp", collective=last), **TIED},
        {**_c("tied-zero1", strategy="fsdp", zero_stage=1, collective=last), **TIED},
        {**_c("tied-zero2", strategy="fsdp", zero_stage=2, collective=last), **TIED},
        {**_c("tied-zero3", strategy="fsdp", zero_stage=3, collective=last), **TIED},
    ]
    if world % 2 == 0:
        cases.append({**_c("tied-pp2", strategy="pipeline", pipeline_stages=2, microbatches=2), **TIED})
    layouts = {2: [2], 3: [], 4: [4, 2]}[world]  # stages P; world 4 with P=2 is DP x PP = 2 x 2
    for stages in layouts:
        for schedule in ("gpipe", "1f1b"):
            for algo in ALGORITHMS:
                cases.append(
                    _c(
                        f"pp{stages}-{schedule}-{algo}",
                        strategy="pipeline",
                        pipeline_stages=stages,
                        microbatches=4,
                        schedule=schedule,
                        collective=algo,
                    )
                )
        cases.append(
            _c(
                f"pp{stages}-ckpt-accum-clip",
                strategy="pipeline",
                pipeline_stages=stages,
                microbatches=2,
                schedule="1f1b",
                collective=last,
                activation_checkpointing=True,
                grad_accum=2,
                grad_clip=0.05,
            )
        )
    return cases


LOSSY_CASES = [  # checked against the reference with a loose tolerance
    _c("lossy-ddp-compress-bf16", strategy="ddp", grad_compression="bf16", collective="native"),
    _c("lossy-ddp-compress-fp16", strategy="ddp", grad_compression="fp16", collective="native"),
    _c("lossy-ddp-bf16", strategy="ddp", precision="bf16", collective="native"),
    _c("lossy-zero3-bf16", strategy="fsdp", zero_stage=3, precision="bf16", collective="native"),
    _c("lossy-pp2-bf16", strategy="pipeline", pipeline_stages=2, precision="bf16", collective="native"),
]


def memory_cases() -> list[dict[str, Any]]:
    cases = [_c("mem-ddp", strategy="ddp", collective="native")]
    cases += [_c(f"mem-zero{s}", strategy="fsdp", zero_stage=s, collective="native") for s in (1, 2, 3)]
    return [{**c, "model_kwargs": MEMORY_MODEL, "steps": 2, "measure": "memory"} for c in cases]


# Peak bytes during a step: an MLP whose 4 hidden layers (37K parameters each) dwarf its
# activations at 2 samples per rank (0.4K floats a layer), so the peak is set by how long
# gradients and gathered parameters live. torch's own FSDP2 on the same per-block units is the yardstick.
PEAK_MLP = {"inputs": 16, "hidden": 192, "classes": 8, "depth": 6}


def peak_cases() -> list[dict[str, Any]]:
    cases = []
    for stage in (2, 3):
        cases.append(_c(f"peak-zero{stage}", strategy="fsdp", zero_stage=stage, collective="native"))
        # FSDP2 resharding after forward is ZeRO-3; keeping the gathered parameters until the
        # backward is the nearest it comes to ZeRO-2 (whose parameters stay whole).
        cases.append(_c(f"peak-fsdp2-{stage}", strategy="torch-fsdp2", zero_stage=stage))
    return [
        {**c, "model": "mlp", "model_kwargs": PEAK_MLP, "batch": 4, "steps": 2, "measure": "memory"}
        for c in cases
    ]


def release_cases() -> list[dict[str, Any]]:
    """Train 2 steps, drop the wrapped model and its optimizer: is everything freed?"""
    cases = [_c("release-ddp", strategy="ddp", collective="native")]
    cases += [_c(f"release-zero{s}", strategy="fsdp", zero_stage=s, collective="native") for s in (1, 2, 3)]
    cases += [_c("release-pp2", strategy="pipeline", pipeline_stages=2, collective="native")]
    return [{**c, "steps": 2, "measure": "release"} for c in cases]


# Resharding: train 5 steps at world 2 and save; resume at world 3 or 4 for steps 5..9.
SAVES = [
    {**_c("save-ddp", strategy="ddp", collective="native"), "steps": 5},
    {**_c("save-zero3", strategy="fsdp", zero_stage=3, collective="native"), "steps": 5},
    {**_c("save-pp2", strategy="pipeline", pipeline_stages=2, collective="native"), "steps": 5},
]


def resume_cases(world: int) -> list[dict[str, Any]]:
    def resume(name: str, source: str, **config: Any) -> dict[str, Any]:
        return {**_c(name, **config), "start_step": 5, "load_from": os.path.join(CHECKPOINTS, source)}

    if world == 3:
        return [
            resume("resume-ddp2-as-zero2", "save-ddp", strategy="fsdp", zero_stage=2, collective="native"),
            resume("resume-zero3", "save-zero3", strategy="fsdp", zero_stage=3, collective="native"),
        ]
    if world == 4:
        return [
            resume("resume-zero3-as-ddp", "save-zero3", strategy="ddp", collective="native"),
            resume(
                "resume-pp2-as-2x2", "save-pp2", strategy="pipeline", pipeline_stages=2, collective="native"
            ),
        ]
    return []


def cases_for(world: int) -> list[dict[str, Any]]:
    # World 2 saves first and the others resume last, so the worlds can run at the same time.
    cases = [{**c, "save_to": os.path.join(CHECKPOINTS, c["name"])} for c in SAVES] if world == 2 else []
    cases += exact_cases(world)
    if world in (2, 4):
        cases += memory_cases()
    if world == 2:
        cases += LOSSY_CASES + peak_cases() + release_cases()
    return cases + resume_cases(world)


WORLD_SIZES = (2, 3, 4)


@functools.cache
def _worlds() -> dict[int, h.World]:
    # All three groups start together: on two shared cores much of a group's time is spent
    # waiting for its peers to be scheduled, and the other groups fill those gaps.
    return {w: h.World(w, cases_for(w)) for w in WORLD_SIZES}


@functools.cache
def results(world: int) -> list[dict[str, Any]]:
    return _worlds()[world].results()


def case(world: int, name: str) -> dict[str, Any]:
    return next(c for c in cases_for(world) if c["name"] == name)
