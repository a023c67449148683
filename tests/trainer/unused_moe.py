"""A routed top-1 MoE whose parameters get no gradient in some steps, trained by the wrappers in
real gloo groups and by one process (tests/trainer/test_parallel_unused.py).

The model: embed -> frozen (requires_grad=False) -> 2 MoE layers (the fully_shard units: router
+ 4 experts each) -> head; `unused` is never called (it lands in fully_shard's root unit with
embed and head). Routing is an input, not learned, so each step's experts are chosen exactly:

    expert 0  every row not routed elsewhere (every rank)
    expert 1  the last rank's rows only: reduced as DDP does (sum over ranks / world)
    expert 2  global row 0 in the first backward of the run only (rank 0), no token afterwards
    expert 3  never
An expert without tokens is not run (as Mixtral's loop does), so in one process it gets
`.grad = None` and AdamW skips it: neither weight decay nor its moments move it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.trainer import _parallel_harness as harness

INPUTS, WIDTH, HIDDEN, CLASSES, EXPERTS = 6, 8, 12, 5, 4
BATCH = 12  # global rows per micro-step: divisible by worlds 2 and 3
STEPS = 3
# eps=1e-5 as tests/trainer/_parallel_harness.py: with 1e-8 a gradient element of 1e-8 (one in
# this model) turns its rounding noise (9e-10, from the order of summation) into a 1e-4 step.
LR, WEIGHT_DECAY, EPS = 1e-2, 0.1, 1e-5


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(h), dim=-1)
        out = h
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue  # no tokens: the expert does not run and gets no gradient
            out = out.index_add(0, rows, expert(h[rows]) * gate[rows, e : e + 1])
        return out


class RoutedMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(INPUTS, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.layers = nn.ModuleList(MoELayer() for _ in range(2))
        self.unused = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def blocks_in_order(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(x)))
        for layer in self.layers:
            h = layer(h, route)
        result: torch.Tensor = self.head(h)
        return result


def build() -> RoutedMoE:
    torch.manual_seed(0)
    return RoutedMoE()


def micro_batch(world: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and routes of one global micro-batch (rank r takes rows r*n..(r+1)*n-1)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(BATCH, INPUTS, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    route = torch.zeros(BATCH, dtype=torch.long)
    route[BATCH - BATCH // world :] = 1
    if step == 0 and micro == 0:
        route[0] = 2
    return x, y, route


def train(model: nn.Module, accum: int, world: int, rank: int, wrapped: bool) -> dict[str, Any]:
    """The user's loop on this rank's rows (all rows when not `wrapped`: one process). After each
    step's last backward: the names whose `.grad is None`; the global parameters (every rank:
    rank0_only=False) after the first step and at the end."""
    from dtjob.trainer.parallel import full_state_dict

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world) if wrapped else slice(0, BATCH)
    out: dict[str, Any] = {"losses": [], "none": [], "states": []}
    for step in range(STEPS):
        total = 0.0
        for micro in range(accum):
            x, y, route = micro_batch(world, step, micro)
            last = micro == accum - 1
            local = model.no_sync() if wrapped and not last else contextlib.nullcontext()
            with local:
                loss = nn.functional.cross_entropy(model(x[rows], route[rows]), y[rows]) / accum
                loss.backward()
            total += loss.item()
        out["losses"].append(total)
        out["none"].append(sorted(name for name, p in model.named_parameters() if p.grad is None))
        opt.step()
        opt.zero_grad()
        if step in (0, STEPS - 1):
            if wrapped:
                out["states"].append(full_state_dict(model, rank0_only=False))
            else:
                out["states"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def wrap(model: nn.Module, strategy: str, collective: str) -> nn.Module:
    """strategy: "ddp" or "zero1" / "zero2" / "zero3"; collective: as the wrappers take it."""
    from dtjob.trainer.parallel import data_parallel, fully_shard

    if strategy == "ddp":
        return data_parallel(model, collective=collective)
    return fully_shard(model, zero_stage=int(strategy.removeprefix("zero")), collective=collective)


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = wrap(build(), case["strategy"], case["collective"])
    return train(model, case["accum"], world, rank, wrapped=True)


def run_world(world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case in one gloo group of `world` processes; each rank's results by case name."""
    return harness.run_world(world, cases, run_case=_run_case)
