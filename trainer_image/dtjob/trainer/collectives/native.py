"""The backend's own collectives ("native"): which calls torch's gloo and NCCL take, and the call.

`accepts` is what auto asks before it counts native among a call's candidates (an unknown backend
is never a candidate; algorithm="native" hands it the call anyway). The tables are torch's:
gloo reduces bool, uint8, int8, int32, int64 and the four float types (not int16 or the unsigned
wider ones), NCCL the same plus float8 (torch's ncclDataType map) but no bitwise ops; complex goes
as its real view on both. Broadcast and all-gather only copy, so any dtype goes, as its bytes
where the backend has no type for it.

How a call is handed over, so that it gives dtjob's results and stays a drop-in:
- the call is issued at once, in the caller's thread, as torch issues it, never queued behind
  dtjob's own async calls (those use p2p tags of their own, so the two never mix up messages);
- AVG on gloo is SUM followed by one division (reduce_ops.finish_average): torch's gloo has AVG
  only from 2.7, and integers get NCCL's truncating average as everywhere in dtjob;
- a non-contiguous tensor is worked on in a contiguous copy. Where something is left to do after
  the backend's call (the division, a copy back), the call runs synchronously even when async_op
  is set, and the handle comes back completed: a step that ran only in wait() would be skipped by
  a caller who never waits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtjob.trainer.collectives.peers import WIRE_DTYPES
from dtjob.trainer.collectives.reduce_ops import RedOpType, finish_average

_R = dist.ReduceOp
_NCCL_DTYPES = WIRE_DTYPES | {
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
}
_DTYPES = {"gloo": WIRE_DTYPES, "nccl": _NCCL_DTYPES}
_OPS = {
    "gloo": frozenset({_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.BAND, _R.BOR, _R.BXOR}),
    "nccl": frozenset({_R.SUM, _R.AVG, _R.PRODUCT, _R.MIN, _R.MAX, _R.PREMUL_SUM}),
}
_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def backend_name(group: dist.ProcessGroup, device: torch.device) -> str:
    """The name ("gloo", "nccl", ...) of the group's backend for `device`; "" if it has none."""
    try:
        return str(group._get_backend(device).name()).lower()
    except RuntimeError:
        return ""
    except AttributeError:  # a Backend binding without name(): ask the group ("cpu:gloo,cuda:nccl")
        names = str(dist.get_backend(group)).lower()
        pairs = dict(part.split(":", 1) for part in names.split(",") if ":" in part)
        return pairs.get(device.type, "" if pairs else names)


def accepts(backend: str, kind: RedOpType | None, dtype: torch.dtype) -> bool:
    """Whether torch's `backend` runs the call, as handed over here (`kind` None: a copy)."""
    if backend not in _DTYPES:
        return False
    if kind is None:
        return True
    return _REAL.get(dtype, dtype) in _DTYPES[backend] and kind in _OPS[backend]


def _bytes_if_needed(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """A contiguous tensor as the backend can copy it: itself, or a view of its bytes."""
    known = _DTYPES.get(backend)
    if known is None or _REAL.get(tensor.dtype, tensor.dtype) in known:
        return tensor
    return tensor.view(torch.uint8)


def _finish_avg(tensor: torch.Tensor, size: int) -> None:
    finish_average(torch.view_as_real(tensor) if tensor.is_complex() else tensor, size)


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp | RedOpType,
    kind: RedOpType,
    group: dist.ProcessGroup,
    async_op: bool,
    backend: str,
) -> dist.Work | None:
    """torch's all_reduce on `tensor` in place; a Work only for an async call left to the backend."""
    average_here = kind == _R.AVG and backend == "gloo"
    work_on = tensor if tensor.is_contiguous() else tensor.contiguous()
    later = average_here or work_on is not tensor
    work = dist.all_reduce(
        work_on, _R.SUM if average_here else op, group=group, async_op=async_op and not later
    )
    if not later:
        return work
    if average_here:
        _finish_avg(work_on, group.size())
    if work_on is not tensor:
        tensor.copy_(work_on)
    return None


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp | RedOpType,
    kind: RedOpType,
    group: dist.ProcessGroup,
    async_op: bool,
    backend: str,
) -> dist.Work | None:
    """torch's reduce_scatter_tensor; a Work only for an async call left to the backend."""
    average_here = kind == _R.AVG and backend == "gloo"
    out = output if output.is_contiguous() else output.contiguous()
    inp = input if input.is_contiguous() else input.contiguous()
    later = average_here or out is not output
    real_out, real_inp = (
        (torch.view_as_real(out), torch.view_as_real(inp)) if out.is_complex() else (out, inp)
    )
    work = dist.reduce_scatter_tensor(
        real_out, real_inp, _R.SUM if average_here else op, group=group, async_op=async_op and not later
    )
    if not later:
        return work
    if average_here:
        _finish_avg(out, group.size())
    if out is not output:
        output.copy_(out)
    return None


def all_gather_into_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool, backend: str
) -> dist.Work | None:
    """torch's all_gather_into_tensor; a Work only for an async call left to the backend."""
    out = output if output.is_contiguous() else output.contiguous()
    inp = input if input.is_contiguous() else input.contiguous()
    later = out is not output
    work = dist.all_gather_into_tensor(
        _bytes_if_needed(out, backend),
        _bytes_if_needed(inp, backend),
        group=group,
        async_op=async_op and not later,
    )
    if not later:
        return work
    output.copy_(out)
    return None


def broadcast(
    tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool, backend: str, global_root: int
) -> dist.Work | None:
    """torch's broadcast from the global rank `global_root` (what every torch version takes; the
    group_src keyword is younger); a Work only for an async call left to the backend."""
    work_on = tensor if tensor.is_contiguous() else tensor.contiguous()
    later = work_on is not tensor
    work = dist.broadcast(
        _bytes_if_needed(work_on, backend), global_root, group=group, async_op=async_op and not later
    )
    if not later:
        return work
    tensor.copy_(work_on)
    return None
