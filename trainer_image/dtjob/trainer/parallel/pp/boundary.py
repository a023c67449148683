"""What crosses a stage boundary: the arguments of the boundary module's call.

Stage s captures the call's (args, kwargs) and sends their tensors, whatever their layout
(wire.exchange sends a contiguous copy; the receiver gets dense tensors of the same shapes), with
the call's structure and its constants (None, numbers, strings, dtypes) in the header. Stage s + 1
rebuilds the call from its own forward's call at that boundary: every tensor and constant is
replaced by what stage s sent, after checking that both calls have the same structure.

Only tensors, plain tuples/lists/dicts of them and constants cross: anything else (a Hugging Face
`ModelOutput`, a user's object holding tensors) has no faithful copy on the next stage, so the
capture raises, naming the argument and how to choose another split. One exception: a Hugging
Face `Cache` (Llama and GPT-2 pass a DynamicCache to every layer, use_cache=True by default) holds
each layer's own keys and values, so each stage keeps its own and it does not cross. A constant
must be the same on every micro-batch of a step: a value that varies with the data belongs in a
tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from dtjob.trainer.parallel.pp.split import SPLIT_HOWTO

_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class CrossingError(ValueError):
    """A boundary call that cannot cross to the next stage."""


@dataclass
class Crossing:
    """One micro-batch's boundary call, as sent: its tensors, and the rest in the header."""

    tensors: list[torch.Tensor]
    constants: list[tuple[int, Any]]  # (leaf index, value) of every non-tensor leaf but a cache
    layout: str  # the call's structure (a pytree spec), which both stages' calls must share


def _is_local(value: Any) -> bool:
    """A Hugging Face cache: per-layer state that each stage keeps for its own layers."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _check(value: Any, where: str, boundary: str) -> None:
    if isinstance(value, torch.Tensor) or type(value) in _CONSTANTS or _is_local(value):
        return
    if type(value) in (tuple, list):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]", boundary)
        return
    if type(value) is dict:
        for k, v in value.items():
            _check(v, f"{where}[{k!r}]", boundary)
        return
    raise CrossingError(
        f"pipeline: boundary {boundary} is called with a {type(value).__name__} ({where}); only tensors, "
        f"tuples/lists/dicts of tensors and constants cross a stage boundary; {SPLIT_HOWTO}"
    )


def _layout(spec: pytree.TreeSpec) -> str:
    return " ".join(str(spec).split())  # on one line: it is quoted in errors


def capture(boundary: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Crossing:
    """The call's tensors, constants and structure; raises if a value cannot cross."""
    for i, a in enumerate(args):
        _check(a, f"argument {i}", boundary)
    for k, v in kwargs.items():
        _check(v, f"argument {k}=", boundary)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    constants = [(i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor) and not _is_local(v)]
    return Crossing(tensors, constants, _layout(spec))


def check_constants(boundary: str, first: Crossing, other: Crossing, microbatch: int) -> None:
    """Micro-batch `microbatch`'s call at `boundary` has the structure and constants of the first."""
    if other.layout != first.layout or other.constants != first.constants:
        raise CrossingError(
            f"pipeline: boundary {boundary} is called with other constants or structure on micro-batch "
            f"{microbatch} than on micro-batch 0 ({other.constants} vs {first.constants}); a value "
            "that varies with the data must be passed as a tensor"
        )


def substitute(
    boundary: str, stage: int, args: Any, kwargs: Any, received: list[torch.Tensor], header: dict[str, Any]
) -> tuple[Any, Any]:
    """This stage's call at `boundary`, its tensors and constants replaced by those received."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    layout = _layout(spec)
    if layout != header["layout"]:
        raise RuntimeError(
            f"pipeline stage {stage}: boundary {boundary} is called with arguments shaped {layout} here but "
            f"{header['layout']} on stage {stage - 1}; the code before a boundary must call it the same "
            "way on every stage"
        )
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if len(slots) != len(received):
        raise RuntimeError(
            f"pipeline stage {stage}: boundary {boundary} is called with {len(slots)} tensors here but "
            f"{len(received)} on stage {stage - 1}"
        )
    for i, t in zip(slots, received, strict=True):
        leaves[i] = t
    for i, value in header["constants"]:
        leaves[i] = value
    new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
    return new_args, new_kwargs
