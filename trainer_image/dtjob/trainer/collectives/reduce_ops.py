"""Reduction operators: `torch.distributed.ReduceOp` mapped onto in-place tensor arithmetic.

Every reduction runs in the tensor's own dtype (float16 and bfloat16 too), which is what gloo does:
each pairwise step rounds to the dtype, so results match torch's gloo collectives up to summation
order. The combine is always `acc = acc OP incoming` on the same two operands in the same order on
whichever rank owns a chunk, so the result of a chunk depends only on the algorithm and the world
size, never on timing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType

# The dtypes the collectives accept. Complex and bool are left out on purpose: MAX/MIN are not
# defined for complex and torch's gloo backend rejects bool reductions.
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int32,
        torch.int64,
        torch.int16,
        torch.int8,
        torch.uint8,
    }
)

Binary = Callable[..., torch.Tensor]

_R = dist.ReduceOp
# Each op as an elementwise torch function taking (a, b, out=...). AVG is SUM followed by one
# division by the world size, applied by the owner of each reduced chunk (see Reduction.finish).
_BINARY: dict[dist.ReduceOp.RedOpType, Binary] = {
    _R.SUM: torch.add,
    _R.AVG: torch.add,
    _R.PRODUCT: torch.mul,
    _R.MAX: torch.maximum,
    _R.MIN: torch.minimum,
    _R.BAND: torch.bitwise_and,
    _R.BOR: torch.bitwise_or,
    _R.BXOR: torch.bitwise_xor,
}


class Reduction:
    """One resolved reduce op for one dtype: how to combine two buffers and how to finish a chunk."""

    def __init__(self, op: ReduceOpLike, dtype: torch.dtype) -> None:
        kind = op if isinstance(op, dist.ReduceOp.RedOpType) else op.op
        if kind not in _BINARY:
            supported = ", ".join(f"ReduceOp.{k.name}" for k in _BINARY)
            raise ValueError(f"op={op!r} is not supported by dtjob collectives; use one of {supported}")
        floating = dtype.is_floating_point
        if kind == _R.AVG and not floating:
            # torch's NCCL backend rejects AVG on integers too and gloo rejects AVG altogether;
            # a silently truncated mean would be worse than an error.
            raise TypeError(
                f"op=ReduceOp.AVG needs a floating-point tensor, got dtype={dtype}; "
                "use ReduceOp.SUM and divide, or convert the tensor to a float dtype"
            )
        if kind in (_R.BAND, _R.BOR, _R.BXOR) and floating:
            raise TypeError(f"op=ReduceOp.{kind.name} needs an integer tensor, got dtype={dtype}")
        self.kind = kind
        self._binary = _BINARY[kind]

    def combine(self, acc: torch.Tensor, incoming: torch.Tensor) -> None:
        """acc = acc OP incoming, in place."""
        self._binary(acc, incoming, out=acc)

    def combine_out(self, acc: torch.Tensor, incoming: torch.Tensor, out: torch.Tensor) -> None:
        """out = acc OP incoming (out may be either operand): combine, written elsewhere."""
        self._binary(acc, incoming, out=out)

    def combine_into_second(self, first: torch.Tensor, acc: torch.Tensor) -> None:
        """acc = first OP acc, in place (same operand order as the partner's `combine`)."""
        self._binary(first, acc, out=acc)

    @property
    def is_average(self) -> bool:
        return self.kind == _R.AVG

    def finish(self, chunk: torch.Tensor, world_size: int) -> None:
        """Applied once by the rank that owns a fully reduced chunk, before it is shared."""
        if self.kind == _R.AVG and world_size > 1:
            chunk.div_(world_size)
