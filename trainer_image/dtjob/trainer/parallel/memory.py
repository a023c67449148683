"""Tensor memory counted on the CPU, where no allocator reports it (on a GPU: torch.cuda's
memory_allocated and max_memory_allocated). Used by the tests and bench/memory3d.py.

- `storage_bytes(tensors)`: the distinct storages behind some tensors, each counted once.
- `live_storages()` / `live_tensor_bytes()`: every CPU storage reachable from Python right now.
- `PeakBytes`: a dispatch mode counting the storages allocated while it is active and not yet
  freed, and their peak.

A storage is counted by its bytes, not by the tensors viewing it: views (a tied weight, DDP's
gradients in their bucket, ZeRO's shards of a flat unit) cost nothing more.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from dtjob.trainer.parallel.shards import local_tensor


def live_storages() -> dict[int, int]:
    """data_ptr -> bytes of every distinct CPU tensor storage reachable from Python objects now."""
    gc.collect()
    out: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(): no __getattr__. A wrapper subclass (FSDP2's DTensor) has no storage of its own:
        # its local tensor is an object of its own here.
        if (
            issubclass(type(obj), torch.Tensor)
            and obj.device.type == "cpu"
            and not is_traceable_wrapper_subclass(obj)
        ):
            storage = obj.untyped_storage()
            if storage.data_ptr():
                out[storage.data_ptr()] = storage.nbytes()
    return out


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable from Python objects right now."""
    return sum(live_storages().values())


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """data_ptr -> bytes of each distinct storage behind `tensors` (a DTensor: its local tensor;
    None and freed storages, such as a ZeRO-3 unit's gathered parameters between steps, skipped):
    a storage that several tensors view (a tied weight, DDP's gradient bucket) counts once."""
    out = {}
    for t in tensors:
        if t is None:
            continue
        st = local_tensor(t).untyped_storage()
        if st.data_ptr():
            out[st.data_ptr()] = st.nbytes()
    return out


class PeakBytes(TorchDispatchMode):
    """Bytes of CPU tensor storages allocated while active and not yet freed: `current`, and `peak`
    since the last `reset_peak()`.

    Every op's outputs pass through here: an output storage that is none of the op's inputs' is a
    new allocation (a view or an in-place op shares an input's), counted until its storage object
    dies (a weakref callback; torch keeps one Python object per live storage). A storage whose size
    changes (UntypedStorage.resize_, as ZeRO-3 and FSDP2 free and regrow gathered parameters, or an
    op resizing its input) counts the difference. Sees what runs on this thread, which is all of a
    CPU step (autograd runs CPU backward on the calling thread) but the collectives' own scratch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._counted: dict[int, int] = {}  # storage _cdata -> bytes counted for it
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._resize = torch.UntypedStorage.resize_

    def reset_peak(self) -> None:
        self.peak = self.current

    def _add(self, storage: torch.UntypedStorage, delta: int) -> None:
        key = storage._cdata
        if key not in self._counted:
            self._counted[key] = 0

            def freed(_: object, k: int = key) -> None:
                self._freed(k)

            self._refs[key] = weakref.ref(storage, freed)
        self._counted[key] += delta
        self.current += delta
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int) -> None:
        self.current -= self._counted.pop(key, 0)
        self._refs.pop(key, None)

    def __enter__(self) -> PeakBytes:
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = storage.nbytes()
            result = tracker._resize(storage, size)
            if storage.device.type == "cpu" and storage.nbytes() != before:
                tracker._add(storage, storage.nbytes() - before)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = [t.untyped_storage() for t in plain_tensors((args, kwargs or {}))]
        sizes = {st._cdata: st.nbytes() for st in inputs}
        out = func(*args, **(kwargs or {}))
        for st in inputs:  # an input resized in place (out= ops, resize_)
            if st.nbytes() != sizes[st._cdata]:
                self._add(st, st.nbytes() - sizes[st._cdata])
                sizes[st._cdata] = st.nbytes()
        for t in plain_tensors(out):
            st = t.untyped_storage()
            if st._cdata not in sizes and st._cdata not in self._counted:
                self._add(st, st.nbytes())
        return out


def plain_tensors(value: Any) -> list[torch.Tensor]:
    """The CPU tensors with storage in `value`: a wrapper subclass (DTensor) by its inner tensors."""
    out = []
    for t in tree_flatten(value)[0]:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            out += plain_tensors([getattr(t, n) for n in names])
        else:
            out.append(t)
    return out
