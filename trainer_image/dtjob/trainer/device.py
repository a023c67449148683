"""Which device a trainer process computes on, and the process-group backend that goes with it.

auto: CUDA when torch.cuda.is_available(), else the CPU; cpu; cuda: CUDA or a clear error. On
CUDA the device is cuda:LOCAL_RANK (one GPU per local process, as torchrun arranges), set as the
current device before the process group exists, so NCCL binds each process to its own GPU.
"""

from __future__ import annotations

import torch

DEVICES = ("auto", "cpu", "cuda")


class DeviceError(Exception):
    """The device asked for is not there (a configuration problem: exit 2)."""


def resolve_device(choice: str, local_rank: int) -> torch.device:
    if choice not in DEVICES:
        raise DeviceError(
            f"--device (env DTJOB_DEVICE): unknown value {choice!r}; choose one of {', '.join(DEVICES)}"
        )
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            "--device cuda (env DTJOB_DEVICE): CUDA is not available here (torch.cuda.is_available() is "
            "False); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"LOCAL_RANK={local_rank} needs GPU {local_rank}, but {count} are visible; run at most {count} "
            "processes per worker (spec.nprocPerWorker) or give each worker more GPUs"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones."""
    return "nccl" if device.type == "cuda" else "gloo"


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where a tensor must be for a collective on a group of `backend`: NCCL takes CUDA tensors only
    (#41: a CPU loss all-reduced over NCCL raised), so `device` (the process's GPU); gloo and
    others the host, which every build of them takes."""
    return device if backend == "nccl" else torch.device("cpu")


def pins(source: torch.device, target: torch.device) -> bool:
    """Whether a copy from `source` to `target` goes through pinned host memory: only a host tensor
    bound for CUDA (#41: `pin_memory()` raises on a tensor already on the GPU)."""
    return source.type == "cpu" and target.type == "cuda"


HOST = torch.device("cpu")


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor of `like`'s shape and dtype, pinned where `like` is on CUDA, so copies
    between the two can be non_blocking (fully_shard's offload="optimizer" keeps its master
    weights, their gradients and, through the user's optimizer, the optimizer state in these)."""
    return torch.empty(like.shape, dtype=like.dtype, device=HOST, pin_memory=pins(HOST, like.device))


def wait_for_copies(device: torch.device) -> None:
    """Wait for the non_blocking copies queued on `device`'s current stream (a no-op on the CPU,
    where a copy is done when it returns): a host tensor they write may be read only after this."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
