"""Point-to-point messages between pipeline stages: batches of tensors, and headers.

Data: all messages of one exchange (schedule.exchanges: the sends that follow one action and the
receives that precede the next) go in one `dist.batch_isend_irecv` call, waited on before the next
action. Under NCCL a stage's p2p operations run in issue order on one stream and a send larger
than NCCL's buffers waits for its receive: a stage that sends before it receives, facing a peer
that does the same, would wait forever; in one batch NCCL runs them together. Between two stages,
messages are sent and received in the same order on both sides (micro-batch order; a message's
tensors in order), which is how NCCL and gloo match them.

Headers: an activation message's shapes are not known to its receiver, so each is preceded by a
header (pickled: each tensor's shape, dtype and requires_grad, plus any extra Python value) sent as
its length and its bytes over `control` (a CPU group, so it never waits for the GPU). The sender
sends it asynchronously when it issues the batch holding the data, before waiting on anything; the
receiver reads it, blocking, before it issues the batch that receives the data. Gradients coming
back have the shapes of the activations that went: no header.

Tags keep the kinds apart on gloo, which matches messages on (peer, tag); dtjob's collectives use
tags >= 2**30.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from dtjob.trainer.parallel.comm import Comm, Handle

TAG_HEADER_LEN, TAG_HEADER, TAG_TENSOR = 11, 12, 13


def send_header(control: Comm, tensors: list[torch.Tensor], extra: Any, dst: int) -> list[Handle]:
    """Describe `tensors` (and send `extra`) to default-group rank `dst`; the handles to wait on."""
    meta = [(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad) for t in tensors]
    blob = torch.frombuffer(bytearray(pickle.dumps((meta, extra))), dtype=torch.uint8)
    length = torch.tensor([blob.numel()], dtype=torch.int64)
    return [
        control.send(length, dst, TAG_HEADER_LEN, async_op=True),
        control.send(blob, dst, TAG_HEADER, async_op=True),
    ]


def recv_header(control: Comm, src: int, device: torch.device) -> tuple[list[torch.Tensor], list[bool], Any]:
    """Read a header from default-group rank `src`: empty tensors on `device` to receive the data
    into, whether each required grad on the sender, and the extra value."""
    length = torch.empty(1, dtype=torch.int64)
    control.recv(length, src, TAG_HEADER_LEN)
    blob = torch.empty(int(length.item()), dtype=torch.uint8)
    control.recv(blob, src, TAG_HEADER)
    meta, extra = pickle.loads(blob.numpy().tobytes())
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=device) for shape, dtype, _ in meta]
    return tensors, [bool(requires_grad) for _, _, requires_grad in meta], extra


def exchange(
    comm: Comm, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]
) -> None:
    """Send each (tensor, default-group rank) of `sends` and receive into each of `recvs`, as one
    batch; returns when all are done."""
    comm.batch_p2p([(t.detach().contiguous(), peer) for t, peer in sends], recvs, TAG_TENSOR)
