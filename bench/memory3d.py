"""Memory per rank of every parallel combination at one model size, against the ZeRO formulas
(issue #44): CPU, gloo, fp32, AdamW, a Hugging Face GPT-2 (tied embedding and head). One
ZeRO-3 row runs under bf16 autocast (the wrappers' mixed_precision="bf16", which works on the
CPU): parameters, gradients and optimizer state stay fp32, so only its peak can differ.

    python bench/memory3d.py                    # GPT-2 of 4.3M parameters, worlds 4 and 8
    python bench/memory3d.py --width 128 --layers 2 --worlds 4

One spawned world per world size runs every combination of that size in turn. Each builds the
model, wraps it, takes one training step (AdamW's state now exists), zero_grad, then a second
step, measured: after its optimizer.step() (before zero_grad), every CPU storage that appeared
since the combination started is counted once, by what holds it (a storage held by two counts
once, in the first category that names it):

- optimizer: AdamW's state (exp_avg, exp_avg_sq, step); with offload it lives on the host;
- host: offload's host shards of master weights and their gradients (`host_tensors()`);
- grads: the `.grad` of every parameter of the wrapper and of the module it wraps;
- params: those parameters, and a ZeRO unit's flat gathered buffer and shard;
- other: whatever else is alive (grad flags, collectives' caches, pipeline stand-ins).

Peak: the bytes held when the measured step starts plus the most allocated during it and not
yet freed (PeakBytes, dtjob/trainer/parallel/memory.py: activations, gathered ZeRO-3 units,
gradient buckets in flight), on the training thread; the collectives' own scratch is not seen.
On a GPU the allocator's max_memory_allocated is the figure (bench/gpu_check.py).

The prediction beside each figure is the README's: Ψ parameters, fp32, 4 bytes each of
parameter and gradient and 8 of Adam state, divided by what splits them: TP x PP split every
tensor of a rank's model (Ψ/(T*P)), ZeRO's stage shards optimizer state (1), gradients (2) and
parameters (3) over the D data-parallel ranks. The ratio shows what the ideal split leaves out:
replicated layer norms and biases under TP, a tied embedding held by both pipeline ends, row
padding of ZeRO's shards, AdamW's 4-byte step per parameter tensor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "trainer_image"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from dtjob.trainer.parallel.memory import PeakBytes, live_storages, storage_bytes  # noqa: E402

CATEGORIES = ("params", "grads", "optimizer", "host", "other")


@dataclass(frozen=True)
class Combo:
    """One way to run the model: the mesh (dp x tp x pp = world) and the data-parallel wrapper
    over m.dp ("ddp": data_parallel; "zero": fully_shard at `zero`; "pipeline": pipeline over
    m.dp_pp, whose replicas average gradients as DDP does)."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    wrapper: str = "ddp"
    zero: int = 0
    offload: str | None = None
    precision: str | None = None  # the wrappers' mixed_precision: autocast, fp32 parameters kept

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def formula(self, psi: int) -> dict[str, float]:
        """Predicted bytes per rank (README's formulas), by category."""
        local = psi / (self.tp * self.pp)
        d = self.dp
        params = 4 * local / (d if self.zero >= 3 else 1)
        grads = 4 * local / (d if self.zero >= 2 else 1)
        optimizer = 8 * local / (d if self.zero >= 1 else 1)
        if self.offload:  # master weights, gradients and Adam state of the owned shard: host
            return {"params": params, "grads": 0, "optimizer": 0, "host": 16 * local / d}
        return {"params": params, "grads": grads, "optimizer": optimizer, "host": 0}


COMBOS = [
    Combo("DDP", dp=4),
    Combo("ZeRO-1", dp=4, wrapper="zero", zero=1),
    Combo("ZeRO-2", dp=4, wrapper="zero", zero=2),
    Combo("ZeRO-3", dp=4, wrapper="zero", zero=3),
    Combo("ZeRO-3 + offload", dp=4, wrapper="zero", zero=3, offload="optimizer"),
    Combo("ZeRO-3, bf16 autocast", dp=4, wrapper="zero", zero=3, precision="bf16"),
    Combo("TP2 x DP2", dp=2, tp=2),
    Combo("TP2 x ZeRO-2", dp=2, tp=2, wrapper="zero", zero=2),
    Combo("TP2 x ZeRO-3", dp=2, tp=2, wrapper="zero", zero=3),
    Combo("PP2 x DP2", dp=2, pp=2, wrapper="pipeline"),
    Combo("TP2 x PP2", tp=2, pp=2, wrapper="pipeline"),
    Combo("DP2 x TP2 x PP2", dp=2, tp=2, pp=2, wrapper="pipeline"),
]


@dataclass(frozen=True)
class ModelConfig:
    """A Hugging Face GPT-2 (transformers' GPT2Config), dropout off."""

    width: int = 256
    layers: int = 4
    heads: int = 4
    vocab: int = 4096
    seq: int = 64
    batch: int = 8  # sequences per global batch: splits over 2 DP ranks x 2 micro-batches


def build(cfg: ModelConfig) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=cfg.vocab,
        n_positions=cfg.seq,
        n_embd=cfg.width,
        n_layer=cfg.layers,
        n_head=cfg.heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def parameter_count(cfg: ModelConfig) -> int:
    """Ψ: distinct parameters (the tied head counted once)."""
    return sum(p.numel() for p in build(cfg).parameters())


def _wrap(combo: Combo, model: nn.Module, m: Any) -> Any:
    from dtjob.trainer import data_parallel, fully_shard, pipeline, tensor_parallel

    if combo.tp > 1:
        model = tensor_parallel(model, "auto", group=m.tp, collective="ring")
    options: dict[str, Any] = {"collective": "ring", "mixed_precision": combo.precision}
    if combo.wrapper == "pipeline":
        return pipeline(model, stages=combo.pp, microbatches=2, group=m.dp_pp, **options)
    if combo.wrapper == "zero":
        return fully_shard(model, zero_stage=combo.zero, offload=combo.offload, group=m.dp, **options)
    return data_parallel(model, group=m.dp, **options)


def _step(combo: Combo, model: Any, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, m: Any) -> None:
    """Forward, backward and AdamW's step on this rank's share of the global batch."""
    mine = tokens.chunk(m.dp_size)[m.dp_rank]
    if combo.wrapper == "pipeline":
        model.step({"input_ids": mine, "labels": mine})
    else:
        model(input_ids=mine, labels=mine).loss.backward()
    optimizer.step()


def _parameters(model: Any) -> list[torch.Tensor]:
    inner = getattr(model, "module", model)
    return [*model.parameters(), *inner.parameters()]


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def held_bytes(model: Any, optimizer: torch.optim.Optimizer, baseline: set[int]) -> dict[str, Any]:
    """Bytes of every live storage not in `baseline`, each counted once, by category (and the
    sizes of the largest storages in "other")."""
    params = _parameters(model)
    units = getattr(model, "units", [])  # fully_shard's flat units
    named = {
        "optimizer": storage_bytes(_optimizer_state(optimizer)),
        "host": storage_bytes(model.host_tensors() if hasattr(model, "host_tensors") else []),
        # ZeRO-1 also keeps each unit's full gradients between backward passes (4 bytes per
        # parameter besides the shard's), in a buffer of its own.
        "grads": storage_bytes([*(p.grad for p in params), *getattr(model, "_grad_full", {}).values()]),
        "params": storage_bytes([*params, *(u.full for u in units), *(u.shard for u in units)]),
    }
    if getattr(model, "offload", None):  # the optimizer's state is on the host
        named["host"] |= named.pop("optimizer")
        named["optimizer"] = {}
    out: dict[str, Any] = dict.fromkeys(CATEGORIES, 0)
    others = []
    for ptr, nbytes in live_storages().items():
        if ptr in baseline:
            continue
        where = next((c for c in ("optimizer", "host", "grads", "params") if ptr in named[c]), "other")
        out[where] += nbytes
        if where == "other":
            others.append(nbytes)
    out["other_largest"] = sorted(others, reverse=True)[:6]  # what "other" is made of
    return out


def measure(combo: Combo, cfg: ModelConfig) -> dict[str, Any]:
    """This rank's figures for `combo` (every rank of the world calls it; ranks outside the
    combination's world size are not allowed: the mesh spans the whole world)."""
    from dtjob.trainer import mesh

    m = mesh(dp=combo.dp, tp=combo.tp, pp=combo.pp)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g) for _ in range(2)]
    baseline = set(live_storages())
    model = _wrap(combo, build(cfg), m)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    _step(combo, model, optimizer, tokens[0], m)
    optimizer.zero_grad()
    at_start = sum(held_bytes(model, optimizer, baseline)[c] for c in CATEGORIES)
    with PeakBytes() as tracker:
        _step(combo, model, optimizer, tokens[1], m)
    held = held_bytes(model, optimizer, baseline)
    total = sum(held[c] for c in CATEGORIES)
    result = {"rank": dist.get_rank(), **held, "total": total, "peak": at_start + tracker.peak}
    del model, optimizer
    dist.barrier()
    return result


def _worker(rank: int, world: int, combos: list[Combo], cfg: ModelConfig, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rv", rank=rank, world_size=world)
    results: dict[str, list[dict[str, Any]]] = {}
    for combo in combos:
        mine = measure(combo, cfg)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        results[combo.name] = every
    if rank == 0:
        Path(out, "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_world(world: int, combos: list[Combo], cfg: ModelConfig) -> dict[str, list[dict[str, Any]]]:
    """Spawn one gloo world of `world` processes, run `combos` (all of that world size) in it;
    each combination's per-rank figures."""
    assert all(c.world == world for c in combos), "every combination must span the whole world"
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, combos, cfg, out), nprocs=world)
        results: dict[str, list[dict[str, Any]]] = json.loads(Path(out, "results.json").read_text())
        return results


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def table(rows: list[dict[str, Any]], psi: int) -> str:
    """Markdown: per combination, the largest rank's figure in MiB, the prediction and the ratio."""
    head = "| combination | ranks | params | grads | optimizer | host | other | held | peak |"
    lines = [
        f"MiB per rank (the largest over ranks): measured / predicted (ratio); Ψ = {psi:,}",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for row in rows:
        cells = []
        for c in ("params", "grads", "optimizer", "host"):
            got, want = row["max"][c], row["formula"][c]
            ratio = f" ({got / want:.3f})" if want else ""
            cells.append(f"{_mib(got)} / {_mib(want)}{ratio}")
        cells += [_mib(row["max"]["other"]), _mib(row["max"]["total"]), _mib(row["max"]["peak"])]
        lines.append(f"| {row['name']} | {row['world']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory3d.json")
    args = parser.parse_args()
    cfg = ModelConfig(width=args.width, layers=args.layers, vocab=args.vocab)
    psi = parameter_count(cfg)
    rows = []
    for world in args.worlds:
        combos = [c for c in COMBOS if c.world == world]
        for name, ranks in run_world(world, combos, cfg).items():
            combo = next(c for c in combos if c.name == name)
            biggest = {k: max(r[k] for r in ranks) for k in (*CATEGORIES, "total", "peak")}
            rows.append(
                {
                    **asdict(combo),
                    "world": world,
                    "formula": combo.formula(psi),
                    "max": biggest,
                    "ranks": ranks,
                }
            )
    print(table(rows, psi))
    result = {
        "date": datetime.date.today().isoformat(),
        "model": {"kind": "transformers GPT2LMHeadModel", **asdict(cfg), "params": psi},
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {platform.platform()}",
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
