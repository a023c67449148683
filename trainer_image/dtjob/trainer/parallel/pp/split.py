"""Where a model is cut into stages, and which stage owns which parameters and buffers.

A split is P-1 *boundary* modules, in the order their forwards run: stage s >= 1 begins where
boundary s is called. Modules are ordered as `named_modules()` lists them (registration order,
which is execution order for sequential models: embeddings, blocks, norm, head). Stage s owns the
parameters and buffers registered by the modules from boundary s (included) to boundary s + 1
(excluded) in that order; the modules around a boundary (its ancestors) lie before it, so their own
direct parameters go to stage 0. A parameter registered by modules of several stages (a tied
embedding and head) is owned by each of them; their gradients are summed between those stages.

`auto_split` chooses the boundaries among the model's blocks (`blocks_in_order()`, else its
repeated blocks), balancing the parameters per stage, since the slowest stage sets the pace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dtjob.trainer.parallel import common
from dtjob.trainer.parallel.pp.schedule import split_stages


@dataclass
class StagePlan:
    boundaries: list[str]  # module names where stages 1..P-1 begin
    stage_of_module: dict[str, int]  # every module's stage by position (ancestors: the earlier one)
    owners: dict[int, set[int]]  # id(parameter) -> stages that own it
    buffer_owner: dict[str, int]  # buffer name -> its stage
    # Per stage s >= 1: the modules that run before boundary s and hold parameters of earlier
    # stages; stage s runs stand-ins for them (see module.py).
    stand_ins: dict[int, list[str]]


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(len(parts))}


def plan(model: nn.Module, boundaries: Sequence[str]) -> StagePlan:
    names = [n for n, _ in model.named_modules()]
    position = {n: i for i, n in enumerate(names)}
    for b in boundaries:
        if b not in position or b == "":
            raise ValueError(f"pipeline split: {type(model).__name__} has no submodule {b!r}")
    at = [position[b] for b in boundaries]
    if at != sorted(at) or len(set(at)) != len(at):
        raise ValueError(f"pipeline split: boundaries {list(boundaries)} are not in the model's module order")
    for b in boundaries:
        for other in boundaries:
            if other != b and other in _ancestors(b):
                raise ValueError(f"pipeline split: boundary {other!r} contains boundary {b!r}")

    def stage_at(i: int) -> int:
        return sum(1 for p in at if p <= i)

    stage_of_module = {n: stage_at(position[n]) for n in names}
    owners: dict[int, set[int]] = {}
    buffer_owner: dict[str, int] = {}
    for n, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(stage_of_module[n])
        for b_name, _ in module.named_buffers(recurse=False):
            buffer_owner[f"{n}.{b_name}" if n else b_name] = stage_of_module[n]
    stand_ins: dict[int, list[str]] = {}
    for s, b in enumerate(boundaries, start=1):
        around = _ancestors(b)
        chosen: list[str] = []
        for n, module in model.named_modules():
            if n in around or position[n] >= position[b] or any(n.startswith(c + ".") for c in chosen):
                continue
            # A ModuleList or ModuleDict is never called itself: its members are.
            container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
            if any(True for _ in module.parameters()) and not container:
                chosen.append(n)
        stand_ins[s] = chosen
    return StagePlan(list(boundaries), stage_of_module, owners, buffer_owner, stand_ins)


# How to choose a split by hand: every error about a split's choice ends with it.
SPLIT_HOWTO = (
    "pass pipeline(..., split=[name, ...]): the P-1 submodule names (as model.named_modules() "
    "lists them) where stages 1..P-1 begin, each called with tensors or tuples/lists/dicts of "
    "tensors (and constants) only"
)


def auto_split(model: nn.Module, stages: int) -> list[str]:
    """P-1 boundaries among the model's blocks, balancing parameters per stage."""
    blocks = common.blocks_in_order(model) or common.repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"pipeline: cannot find the blocks of {type(model).__name__}; {SPLIT_HOWTO}, or give the "
            "model a blocks_in_order() method"
        )
    names = common.module_names(model)
    block_names = [names[id(b)] for b in blocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    costs = [sum(p.numel() for p in b.parameters()) for b in blocks]
    # Parameters outside the blocks (embeddings, final norm, head) sit at both ends.
    costs[0] += outside // 2
    costs[-1] += outside - outside // 2
    spans = split_stages(len(blocks), stages, costs)
    return [block_names[lo] for lo, _hi in spans[1:]]


def spec_of(value: object) -> object:
    """The shapes and dtypes of a module's output: a tensor, or tuples/lists/dicts (a Hugging Face
    `ModelOutput` too) of them and None."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, (tuple, list)):
        return ("seq", [spec_of(v) for v in value])
    if isinstance(value, dict):  # kept with its class: a ModelOutput is rebuilt as one
        return ("map", type(value), {k: spec_of(v) for k, v in value.items()})
    if value is None:
        return ("none",)
    raise TypeError(
        f"pipeline: a module before a stage boundary returned {type(value).__name__}; stand-ins can "
        "only reproduce tensors, tuples, lists and dicts of them"
    )


def zeros_of(spec: object, device: torch.device) -> object:
    """A stand-in output shaped like `spec`: zeros that require grad, so a use after the boundary
    is caught (see module.py)."""
    assert isinstance(spec, tuple)
    if spec[0] == "tensor":
        shape: tuple[int, ...] = spec[1]
        dt: torch.dtype = getattr(torch, spec[2])
        return torch.zeros(shape, dtype=dt, device=device, requires_grad=dt.is_floating_point)
    if spec[0] == "seq":
        return tuple(zeros_of(s, device) for s in spec[1])
    if spec[0] == "map":
        return spec[1](**{k: zeros_of(s, device) for k, s in spec[2].items()})
    return None
