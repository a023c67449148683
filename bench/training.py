"""dtjob's strategies vs torch's, side by side in one run, same model and batch.

    python bench/training.py [--worlds 2 4] [--repeats 5] [--steps 5] [--collective auto]

Pairs (each world size is one spawned gloo process group; the two sides alternate, run after run,
so load drifts on this shared machine hit both alike):
  ddp:        dtjob data_parallel      vs torch.nn.parallel.DistributedDataParallel
  zero3:      dtjob fully_shard ZeRO-3 vs torch FSDP2 (fully_shard per unit on a CPU device mesh)
  pp-gpipe:   dtjob pipeline, GPipe    vs torch.distributed.pipelining ScheduleGPipe
  pp-1f1b:    dtjob pipeline, 1F1B     vs torch.distributed.pipelining Schedule1F1B
Both sides of ddp and zero3 run the same user loop (forward, loss, backward, optimizer.step) on
the wrapped module. --model hf-gpt2 runs those two pairs on a transformers GPT-2 of the same size
(its head tied to its embedding), with the loss line `model(input_ids=x, labels=x).loss`.
Pipelines use P = world size stages. Reports samples/s (median over runs) and their ratio, the
model-state bytes (parameters + gradients + optimizer state) each rank holds between steps, and
dtjob's measured pipeline bubble: 1 - (time in forward/backward compute) / (step time), per stage,
next to the ideal (P-1)/(M+P-1). On 2 shared cores, P processes cannot compute concurrently, so
the measured bubble is an upper bound dominated by time-slicing, not by the schedule alone.

Writes bench/results/training[-hf-gpt2].json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from dtjob.devcluster.host import free_port
from dtjob.trainer.models import GPT, GPTConfig

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = {"vocab": 256, "width": 128, "depth": 4, "heads": 4, "seq_len": 64}
GLOBAL_BATCH = 16
MICROBATCHES = 4


def _model(name: str = "gpt") -> nn.Module:
    torch.manual_seed(0)
    if name == "hf-gpt2":
        import transformers

        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(
            vocab_size=MODEL["vocab"],
            n_positions=MODEL["seq_len"],
            n_embd=MODEL["width"],
            n_layer=MODEL["depth"],
            n_head=MODEL["heads"],
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    return GPT(GPTConfig(**MODEL))


def _batch(step: int, rows: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL["vocab"], (GLOBAL_BATCH, MODEL["seq_len"] + 1), generator=g)
    tokens = tokens[offset : offset + rows]
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensors: this rank's shard

    total = 0
    for p in params:
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                total += local(v).numel() * v.element_size()
    return total


def _no_bubble() -> float | None:
    return None


@dataclass
class Runner:
    """One side of a pair: step(s) trains global batch s; state_bytes() after stepping."""

    step: Callable[[int], None]
    state_bytes: Callable[[], int]
    bubble: Callable[[], float | None] = _no_bubble


def dtjob_runner(kind: str, collective: str, model_name: str) -> Runner:
    """dtjob's wrapper, trained in the same user loop as torch's side."""
    from dtjob.trainer.parallel import data_parallel, fully_shard, pipeline

    world = dist.get_world_size()
    model = _model(model_name)
    if kind.startswith("pp"):
        schedule = "gpipe" if kind == "pp-gpipe" else "1f1b"
        pipe = pipeline(
            model,
            stages=world,
            microbatches=MICROBATCHES,
            schedule=schedule,
            collective=collective,
            loss_fn=_loss,
        )
        optimizer = _optimizer(pipe.parameters())

        def pp_step(s: int) -> None:
            pipe.step(*_batch(s, GLOBAL_BATCH, 0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        def bubble() -> float | None:
            return 1.0 - pipe.last_step_busy_s / pipe.last_step_total_s

        return Runner(pp_step, lambda: _state_bytes(list(pipe.parameters()), optimizer), bubble)
    wrapped = (
        data_parallel(model, collective=collective)
        if kind == "ddp"
        else fully_shard(model, collective=collective)
    )
    return _loop_runner(wrapped, model_name)


def _loop_runner(wrapped: nn.Module, model_name: str) -> Runner:
    """The user's loop both sides run: forward, loss, backward, optimizer step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    optimizer = _optimizer(wrapped.parameters())
    rows = GLOBAL_BATCH // world

    def step(s: int) -> None:
        x, y = _batch(s, rows, rank * rows)
        optimizer.zero_grad(set_to_none=False)
        if model_name == "hf-gpt2":
            wrapped(input_ids=x, labels=x).loss.backward()
        else:
            _loss(wrapped(x), y).backward()
        optimizer.step()

    return Runner(step, lambda: _state_bytes(list(wrapped.parameters()), optimizer))


def torch_runner(kind: str, model_name: str) -> Runner:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model(model_name)
    if kind in ("ddp", "zero3"):
        if kind == "ddp":
            return _loop_runner(nn.parallel.DistributedDataParallel(model), model_name)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from dtjob.trainer.parallel.fsdp import auto_units

        mesh = init_device_mesh("cpu", (world,))
        for block in auto_units(model):  # the same units dtjob picks
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _loop_runner(model, model_name)

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dtjob.trainer.parallel.pp import split_stages

    blocks = list(model.blocks_in_order())  # type: ignore[operator]
    costs = [sum(p.numel() for p in b.parameters()) for b in blocks]
    lo, hi = split_stages(len(blocks), world, costs)[rank]  # the same split dtjob uses
    stage_module = nn.Sequential(*blocks[lo:hi])
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule_class = ScheduleGPipe if kind == "pp-gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=MICROBATCHES, loss_fn=_loss)
    optimizer = _optimizer(stage_module.parameters())

    def pp_step(s: int) -> None:
        x, y = _batch(s, GLOBAL_BATCH, 0)
        optimizer.zero_grad(set_to_none=False)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()

    return Runner(pp_step, lambda: _state_bytes(list(stage_module.parameters()), optimizer))


def _timed(runner: Runner, first_step: int, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for s in range(first_step, first_step + steps):
        runner.step(s)
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    kinds = ("ddp", "zero3", "pp-gpipe", "pp-1f1b") if args.model == "gpt" else ("ddp", "zero3")
    for kind in kinds:
        sides = {
            "dtjob": dtjob_runner(kind, args.collective, args.model),
            "torch": torch_runner(kind, args.model),
        }
        for runner in sides.values():  # warm-up: first-step allocations, lazy optimizer state
            _timed(runner, 0, 2)
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        bubbles: list[float] = []
        for repeat in range(args.repeats):
            for name, runner in sides.items():
                seconds[name].append(_timed(runner, 10 + repeat * args.steps, args.steps))
                bubble = runner.bubble()
                if name == "dtjob" and bubble is not None:
                    bubbles.append(bubble)
        entry: dict[str, Any] = {}
        for name, runner in sides.items():
            sps = [GLOBAL_BATCH * args.steps / s for s in seconds[name]]
            state = torch.tensor([runner.state_bytes()], dtype=torch.int64)
            per_rank = [torch.zeros_like(state) for _ in range(world)]
            dist.all_gather(per_rank, state)
            entry[name] = {
                "samples_per_s_median": statistics.median(sps),
                "samples_per_s_runs": sps,
                "state_bytes_per_rank": [int(t.item()) for t in per_rank],
            }
        entry["ratio_dtjob_over_torch"] = (
            entry["dtjob"]["samples_per_s_median"] / entry["torch"]["samples_per_s_median"]
        )
        if bubbles:
            mine = torch.tensor([statistics.median(bubbles)], dtype=torch.float64)
            stages = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(stages, mine)
            entry["bubble_measured_per_stage"] = [float(t.item()) for t in stages]
            entry["bubble_ideal"] = (world - 1) / (MICROBATCHES + world - 1)
        results[kind] = entry
        del sides
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted(report["worlds"], key=int)
    kinds = list(report["worlds"][worlds[0]])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(worlds)
    for i, w in enumerate(worlds):
        xs = [k + i * width for k in range(len(kinds))]
        ratios = [report["worlds"][w][k]["ratio_dtjob_over_torch"] for k in kinds]
        left.bar(xs, ratios, width, label=f"world {w}")
        mine = [max(report["worlds"][w][k]["dtjob"]["state_bytes_per_rank"]) / 2**20 for k in kinds]
        theirs = [max(report["worlds"][w][k]["torch"]["state_bytes_per_rank"]) / 2**20 for k in kinds]
        right.bar(xs, mine, width / 2, label=f"dtjob, world {w}")
        right.bar([x + width / 2 for x in xs], theirs, width / 2, label=f"torch, world {w}", alpha=0.6)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks([k + width * (len(worlds) - 1) / 2 for k in range(len(kinds))], kinds)
    left.set_ylabel("samples/s, dtjob / torch (median)")
    left.legend()
    right.set_xticks([k + width * (len(worlds) - 1) / 2 for k in range(len(kinds))], kinds)
    right.set_ylabel("model-state MiB on the fullest rank")
    right.legend(fontsize=7)
    fig.suptitle(f"dtjob vs torch, GPT {MODEL}, global batch {GLOBAL_BATCH}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per side (median reported)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per timed run")
    parser.add_argument("--collective", default="auto", choices=("auto", "ring", "hd", "native"))
    parser.add_argument(
        "--model",
        default="gpt",
        choices=("gpt", "hf-gpt2"),
        help="dtjob's GPT (every pair) or a transformers GPT-2 of the same size (ddp and zero3 pairs)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / ("training.json" if args.model == "gpt" else f"training-{args.model}.json")
    report: dict[str, Any] = {
        "model": {"name": args.model, **MODEL},
        "global_batch": GLOBAL_BATCH,
        "microbatches": MICROBATCHES,
        "collective": args.collective,
        "repeats": args.repeats,
        "steps_per_run": args.steps,
        "torch": torch.__version__,
        "worlds": {},
    }
    for world in args.worlds:
        report["worlds"][str(world)] = run_world(world, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    header = ("world", "pair", "dtjob/s", "torch/s", "ratio", "dtjob MiB", "torch MiB")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 9, 9, 9, 6, 9, 9), strict=True)))
    for world, entries in report["worlds"].items():
        for kind, e in entries.items():
            mib = [max(e[side]["state_bytes_per_rank"]) / 2**20 for side in ("dtjob", "torch")]
            print(
                f"{world:>5} {kind:>9} {e['dtjob']['samples_per_s_median']:9.1f} "
                f"{e['torch']['samples_per_s_median']:9.1f} {e['ratio_dtjob_over_torch']:6.2f} "
                f"{mib[0]:9.2f} {mib[1]:9.2f}"
            )
            if "bubble_ideal" in e:
                measured = ", ".join(f"{b:.2f}" for b in e["bubble_measured_per_stage"])
                print(f"{'':>15} bubble measured per stage [{measured}] vs ideal {e['bubble_ideal']:.2f}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
