"""Optimizers whose update is not elementwise cannot step on pieces of parameters: refused.

A ZeRO rank holds some rows of each parameter (a DTensor's local tensor), so an optimizer whose
update of an element reads other elements of the same parameter sees the wrong ones, silently:
Adafactor factors its second moment over the parameter's rows and columns, Muon orthogonalises
the whole matrix, LBFGS takes dot products over every parameter. A pipeline stage holds only its
own parameters, which LBFGS's line search over all of them cannot run on. Each wrapper marks the
parameters it hands out; a global optimizer pre-step hook
(torch.optim.optimizer.register_optimizer_step_pre_hook) checks an optimizer's parameters once, at
its first step, and raises naming the optimizer and what to use.
Optimizers outside torch.optim are not known here and are let through.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_ATTR = "_dtjob_held_by"  # "fully_shard" (a piece of a parameter) or "pipeline" (one stage's)
_REFUSED = {
    "fully_shard": {"Adafactor", "Muon", "LBFGS"},
    "pipeline": {"LBFGS"},
}
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_installed: list[Any] = []


def mark(param: torch.Tensor, wrapper: str) -> None:
    setattr(param, _ATTR, wrapper)
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    if optimizer in _checked:
        return
    wrappers = {
        str(getattr(p, _ATTR)) for g in optimizer.param_groups for p in g["params"] if hasattr(p, _ATTR)
    }
    name = type(optimizer).__name__
    for wrapper in wrappers:
        if name in _REFUSED[wrapper]:
            raise ValueError(
                f"{name} cannot train a model wrapped by {wrapper}: its update of a parameter reads the "
                f"whole parameter (or every parameter), and {wrapper} gives each rank only "
                f"{'a piece of each' if wrapper == 'fully_shard' else 'its stage'}; use an elementwise "
                "optimizer (SGD, Adam, AdamW, ...), or data_parallel"
            )
    _checked.add(optimizer)
