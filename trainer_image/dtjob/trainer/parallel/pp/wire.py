"""Point-to-point messages between pipeline stages: a list of tensors and a small header.

A message is a header (pickled: each tensor's shape, dtype and requires_grad, plus any extra
Python value) sent as its length and its bytes over `control` (a CPU group, so reading it never
waits for the GPU), then the tensors one by one over `comm`. Sends are asynchronous (the caller
waits on the handles); receives block. Tags keep the kinds apart on gloo, which matches messages on
(peer, tag); dtjob's collectives use tags >= 2**30.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from dtjob.trainer.parallel.comm import Comm, Handle

TAG_HEADER_LEN, TAG_HEADER, TAG_TENSOR = 11, 12, 13


def send(comm: Comm, control: Comm, tensors: list[torch.Tensor], extra: Any, dst: int) -> list[Handle]:
    """Send `tensors` (and `extra`) to default-group rank `dst`; returns the handles to wait on."""
    meta = [(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad) for t in tensors]
    blob = torch.frombuffer(bytearray(pickle.dumps((meta, extra))), dtype=torch.uint8)
    length = torch.tensor([blob.numel()], dtype=torch.int64)
    handles = [
        control.send(length, dst, TAG_HEADER_LEN, async_op=True),
        control.send(blob, dst, TAG_HEADER, async_op=True),
    ]
    for t in tensors:
        handles.append(comm.send(t.detach().contiguous(), dst, TAG_TENSOR, async_op=True))
    return handles


def recv(comm: Comm, control: Comm, src: int, device: torch.device) -> tuple[list[torch.Tensor], Any]:
    """Receive what `send` sent from default-group rank `src`: the tensors on `device` (floating
    ones that required grad on the sender require grad here) and the extra value."""
    length = torch.empty(1, dtype=torch.int64)
    control.recv(length, src, TAG_HEADER_LEN)
    blob = torch.empty(int(length.item()), dtype=torch.uint8)
    control.recv(blob, src, TAG_HEADER)
    meta, extra = pickle.loads(blob.numpy().tobytes())
    tensors = []
    for shape, dtype, requires_grad in meta:
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        comm.recv(t, src, TAG_TENSOR)
        tensors.append(t.requires_grad_(bool(requires_grad)))
    return tensors, extra


def recv_into(comm: Comm, tensors: list[torch.Tensor], src: int) -> None:
    """Receive tensors of known shapes (gradients coming back) into `tensors`, in order."""
    for t in tensors:
        comm.recv(t, src, TAG_TENSOR)


def send_tensors(comm: Comm, tensors: list[torch.Tensor], dst: int) -> list[Handle]:
    """Send tensors whose shapes the receiver knows (gradients going back)."""
    return [comm.send(t.detach().contiguous(), dst, TAG_TENSOR, async_op=True) for t in tensors]
