"""Reduction operators: `torch.distributed.ReduceOp` mapped onto in-place tensor arithmetic.

Every reduction runs in the tensor's own dtype (float16 and bfloat16 too), which is what gloo and
NCCL do: each pairwise step rounds to the dtype, so results match torch's collectives up to
summation order. The combine is always `acc = acc OP incoming` on the same two operands in the
same order on whichever rank owns a chunk, so the result of a chunk depends only on the algorithm
and the world size, never on timing.

What is reduced, as torch's backends do it:
- bool: SUM and MAX are a logical or, PRODUCT and MIN a logical and (NCCL maps bool SUM to MAX);
  AVG is refused, as by gloo and NCCL.
- complex: SUM and AVG on the real and imaginary parts (torch views complex tensors as real);
  every other op is refused with torch's ValueError.
- integers: AVG is the sum (wrapping in the dtype) divided once by the world size, truncated
  toward zero: NCCL's ncclAvg for integers. (torch's gloo refuses integer AVG.)
- BAND/BOR/BXOR on bool and integers only.
dtypes torch has no elementwise add for (uint16/32/64, the float8 types) cannot be reduced here;
broadcast and all-gather move any dtype, as bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist

from dtjob.trainer.collectives.errors import InvalidArgument, InvalidType

ReduceOpLike = dist.ReduceOp | dist.ReduceOp.RedOpType
RedOpType = dist.ReduceOp.RedOpType

INTEGER_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
COMPLEX_DTYPES = frozenset({torch.complex32, torch.complex64, torch.complex128})
# The dtypes dtjob's own algorithms reduce.
REDUCIBLE_DTYPES = INTEGER_DTYPES | FLOAT_DTYPES | COMPLEX_DTYPES

Binary = Callable[..., torch.Tensor]

_R = dist.ReduceOp
# Each op as an elementwise torch function taking (a, b, out=...). AVG is SUM followed by one
# division by the world size, applied by the owner of each reduced chunk (see Reduction.finish).
_BINARY: dict[RedOpType, Binary] = {
    _R.SUM: torch.add,
    _R.AVG: torch.add,
    _R.PRODUCT: torch.mul,
    _R.MAX: torch.maximum,
    _R.MIN: torch.minimum,
    _R.BAND: torch.bitwise_and,
    _R.BOR: torch.bitwise_or,
    _R.BXOR: torch.bitwise_xor,
}
_BITWISE = (_R.BAND, _R.BOR, _R.BXOR)


def op_kind(op: object, name: str) -> RedOpType:
    """The RedOpType of `op` (ReduceOp.SUM, or a ReduceOp object such as NCCL's premul-sum)."""
    if isinstance(op, RedOpType):
        return op
    if isinstance(op, dist.ReduceOp):
        return op.op
    raise TypeError(f"{name}: op must be a torch.distributed.ReduceOp such as ReduceOp.SUM, got {op!r}")


def check_op(kind: RedOpType, dtype: torch.dtype, name: str) -> None:
    """The rules every backend applies to (op, dtype); raises torch's class for a breach."""
    if dtype.is_complex and kind not in (_R.SUM, _R.AVG):
        raise InvalidArgument(
            f"{name} does not support ReduceOp.{kind.name} on complex tensors; use SUM or AVG"
        )
    if dtype == torch.bool and kind == _R.AVG:
        raise InvalidType(f"{name}: cannot use ReduceOp.AVG with boolean inputs; use SUM (a logical or)")
    if kind in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise InvalidArgument(
            f"{name}: cannot use ReduceOp.{kind.name} with non-integral dtype {dtype}; "
            "bitwise ops need a bool or integer tensor"
        )


class Reduction:
    """One resolved reduce op for one dtype: how to combine two buffers and how to finish a chunk.

    Raises (before any message is sent) where dtjob's algorithms cannot do it: the backend's own
    collective (algorithm="native") may still (NCCL's PREMUL_SUM, float8 on NCCL)."""

    def __init__(self, op: ReduceOpLike, dtype: torch.dtype, name: str = "all_reduce") -> None:
        kind = op_kind(op, name)
        check_op(kind, dtype, name)
        if kind not in _BINARY:
            supported = ", ".join(f"ReduceOp.{k.name}" for k in _BINARY)
            raise InvalidArgument(
                f"{name}: op=ReduceOp.{kind.name} is not supported by dtjob's algorithms (use one of "
                f"{supported}, or algorithm='native' where the backend has it, e.g. NCCL's PREMUL_SUM)"
            )
        if dtype not in REDUCIBLE_DTYPES:
            raise InvalidType(
                f"{name}: dtjob's algorithms cannot reduce dtype {dtype} (torch has no elementwise "
                f"add for it); use one of {sorted(str(d).removeprefix('torch.') for d in REDUCIBLE_DTYPES)}, "
                "or algorithm='native' where the backend reduces it"
            )
        self.kind = kind
        self.dtype = dtype
        self._binary = _BINARY[kind]
        self._average = kind == _R.AVG

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The 1-D buffer the arithmetic runs on: complex as (real, imaginary) pairs."""
        return torch.view_as_real(flat).view(-1) if flat.is_complex() else flat

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
        return self._average

    def without_finish(self) -> Reduction:
        """The same combine with no division: for the phases of a composite algorithm (hier),
        which divides once by the whole group's size at the end."""
        phase = copy.copy(self)
        phase._average = False
        return phase

    def finish(self, chunk: torch.Tensor, world_size: int) -> None:
        """Applied once by the rank that owns a fully reduced chunk, before it is shared."""
        if self._average and world_size > 1:
            finish_average(chunk, world_size)


def finish_average(chunk: torch.Tensor, world_size: int) -> None:
    """sum -> average in place: a float division, or for integers NCCL's truncating one."""
    if chunk.is_floating_point():
        chunk.div_(world_size)
    else:
        torch.div(chunk, world_size, rounding_mode="trunc", out=chunk)
