"""Pieces every wrapper shares: the wrapper base class, model structure, buffers, precision and
activation checkpointing."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtjob.trainer.parallel.comm import Comm

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Wrapper(nn.Module):
    """A module that trains `self.module` across ranks and is used in place of it.

    Attribute lookups it does not answer go to the wrapped module (`wrapped.config`,
    `wrapped.generate`), and parameter and state-dict names are the wrapped module's own, without a
    "module." prefix. Moving or casting a wrapper (`.to()`, `.cuda()`, `.half()`) is refused: its
    communication buffers alias the parameters, so move the model before wrapping it.
    """

    module: nn.Module
    comm: Comm

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return self._forwarded(getattr(self.module, name))

    def _forwarded(self, value: Any) -> Any:
        """What `__getattr__` hands out for an attribute of the wrapped module (fully_shard wraps
        its methods so they run on the full parameters, fsdp/unshard.py)."""
        return value

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Any:
        raise NotSupported(
            f"{type(self).__name__}: moving or casting a wrapped model (.to(), .cuda(), .half(), ...) is "
            "not supported; move the model to its device and dtype before wrapping it"
        )

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """`.to()` where the model already is (its device and dtype: what scripts written for
        torch's DDP do after wrapping) returns the wrapper; a real move or cast is refused (_apply)."""
        device, dtype, _non_blocking, _format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.module.parameters(), *self.module.buffers()]
        if all(
            (device is None or _same_device(t.device, device))
            and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
        return super().to(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"world={self.comm.size}, collective={self.comm.algorithm!r}"

    # Which part of a global batch this rank reads (ElasticSession.batch_sampler): its place among
    # the replicas the wrapper averages over, its group (mesh(...).dp under tensor parallelism,
    # where the TP ranks of a replica read the same rows). A pipeline answers its replicas.
    @property
    def data_parallel_rank(self) -> int:
        return self.comm.rank

    @property
    def data_parallel_size(self) -> int:
        return self.comm.size


class GradientSync:
    """torch's `no_sync()` and FSDP2's `set_requires_gradient_sync()` for a wrapper whose backward
    reduces gradients across the group only while `self._sync` is True (data_parallel and
    fully_shard: one implementation for both). `_accumulates_locally()`: whether it can keep full
    gradients locally at all; ZeRO-2/3 hold only gradient shards, so they reduce-scatter every
    backward (the shards accumulate) and both calls change nothing there."""

    _sync: bool

    def _accumulates_locally(self) -> bool:
        return True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communicating."""
        previous, self._sync = self._sync, not self._accumulates_locally()
        try:
            yield
        finally:
            self._sync = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """The persistent form of no_sync(): False, backward passes accumulate locally until it is
        set True again; the next backward then reduces the sum."""
        self._sync = bool(requires_gradient_sync) or not self._accumulates_locally()


def _same_device(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index == want.index)


class NotSupported(NotImplementedError, RuntimeError):
    """A method of torch's DDP or FSDP2 (or nn.Module) that a dtjob wrapper does not offer. Its
    message names what to do instead. Both a NotImplementedError (what is missing) and a
    RuntimeError (what the wrappers raised for a move or cast before issue #40)."""


def not_supported(wrapper: str, method: str, instead: str) -> NoReturn:
    """Raise NotSupported for `wrapper`.`method`(), naming the alternative `instead`."""
    raise NotSupported(f"{wrapper}.{method}() is not supported by dtjob's {wrapper}; {instead}")


# What to say instead of a method, shared by the wrappers (issue #40, README "The torch surface").
INSTEAD_COLLECTIVE = "dtjob's own collectives reduce the gradients: choose their algorithm with collective="
INSTEAD_COMM_HOOK = (
    f"{INSTEAD_COLLECTIVE}, and compress them with data_parallel(grad_compression='bf16' or 'fp16')"
)
INSTEAD_JOIN = (
    "give every rank the same number of batches (ElasticSession.batch_sampler / "
    "dtjob.trainer.data.GlobalBatchSampler do; a DataLoader with drop_last=True over a "
    "DistributedSampler does)"
)


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that belong in a state dict (those registered with persistent=True), by name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def blocks_in_order(model: nn.Module) -> list[nn.Module] | None:
    """The model as a sequence of blocks, where it says so: `model.blocks_in_order()` (dtjob's
    models define it) or the children of an `nn.Sequential`; None otherwise."""
    method = getattr(model, "blocks_in_order", None)
    if callable(method):
        blocks = list(method())
        if not blocks:
            raise ValueError(f"{type(model).__name__}.blocks_in_order() returned no blocks")
        return blocks
    if isinstance(model, nn.Sequential):
        return list(model)
    return None


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: those whose class the model names in `_no_split_modules`
    (Hugging Face models: GPT2Block, LlamaDecoderLayer), else the children of its longest
    `nn.ModuleList` of modules of one class; [] when it has neither."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if found:
            return found
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > len(best) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best if len(best) > 1 else []


def module_names(model: nn.Module) -> dict[int, str]:
    """id(submodule) -> its qualified name in `model` ("" for the model itself)."""
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def resolve_modules(model: nn.Module, given: Iterable[nn.Module | str], what: str) -> list[nn.Module]:
    """Modules given as objects or qualified names, each checked to be part of `model`."""
    names = module_names(model)
    out: list[nn.Module] = []
    for item in given:
        if isinstance(item, str):
            try:
                out.append(model.get_submodule(item))
            except AttributeError:
                raise ValueError(f"{what}: {type(model).__name__} has no submodule {item!r}") from None
        elif isinstance(item, nn.Module) and id(item) in names:
            out.append(item)
        else:
            raise ValueError(f"{what}: {item!r} is not a submodule of the model (give modules or names)")
    return out


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples, lists and dicts (a Hugging Face ModelOutput is a dict)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def autocast(precision: str | None, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16/fp16: compute under autocast on `device` while weights, gradients and their reduction
    stay fp32; None or "fp32": no autocast."""
    if precision is None or precision == "fp32":
        return contextlib.nullcontext()
    if precision not in PRECISIONS:
        raise ValueError(f"mixed_precision must be one of None, 'bf16', 'fp16', got {precision!r}")
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision])


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    Patches the instance's forward (not the class, and without a wrapper module) so parameter
    names, and therefore checkpoints, do not change. Module hooks still run around the call.
    """
    for block in blocks:
        original = block.forward

        def checkpointed(*args: Any, _forward: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed


def broadcast_from_rank0(tensors: list[torch.Tensor], comm: Comm) -> None:
    """Make every rank's tensors equal rank 0's: one broadcast per dtype, through a flat buffer."""
    by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, 0)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()


class BufferBroadcast:
    """`broadcast_buffers=True` as torch's DDP does it: before a forward, the buffers (BatchNorm's
    running statistics, ...) of rank 0 of `comm`'s group are copied to every member, in one
    broadcast per dtype.

    When, as torch's DDP (its require_forward_param_sync): before the first forward, and before a
    forward that follows one run with gradients enabled whose gradients are reduced (not under
    no_sync). So the first forward of an evaluation (torch.no_grad) after training broadcasts, the
    following ones do not (eval-mode BatchNorm changes no buffer), and neither does the forward
    after a no_sync one. `wanted(name)` picks the buffers (a pipeline stage: its own); the list is
    read again each time, since a model may reassign a buffer."""

    def __init__(
        self, module: nn.Module, comm: Comm, enabled: bool, wanted: Callable[[str], bool] | None = None
    ) -> None:
        self.module = module
        self.comm = comm
        self.enabled = enabled
        self.wanted = wanted
        self._due = True
        self.broadcasts = 0  # forwards that broadcast, for tests and logs

    def before_forward(self, reduces_gradients: bool) -> None:
        """Call at the start of a forward; `reduces_gradients`: this forward's backward will reduce
        gradients across the group (grad enabled and not under no_sync)."""
        due, self._due = self._due, reduces_gradients
        if not (due and self.enabled and self.comm.size > 1):
            return
        buffers = [b for n, b in self.module.named_buffers() if self.wanted is None or self.wanted(n)]
        if buffers:
            # Unlike torch's DDP, the copy bumps the buffers' version counters: a graph that saved
            # one (eval-mode BatchNorm) and has not run its backward yet raises in backward
            # rather than silently using the overwritten values.
            broadcast_from_rank0(buffers, self.comm)
            self.broadcasts += 1


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the current backward pass has finished (from inside a backward hook),
    before `loss.backward()` returns: how torch's DDP finishes its reduction."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def weak_hook(owner: object, method: str, *bound: Any) -> Callable[..., Any]:
    """A hook calling `owner.<method>(*bound, *hook_args)` through a weak reference to `owner`; a
    no-op once `owner` is gone.

    For the hooks a wrapper puts on the parameters and submodules of the module it holds: a hook
    holding the wrapper closes a cycle (wrapper -> module -> parameter -> hook -> wrapper), and a
    tensor's hooks are referenced from C++, where gc.collect() cannot see them, so every wrapped
    model built would stay in memory with its gradients and optimizer-facing shards. `bound` must
    not hold the module's tensors either (pass indices, not objects that hold parameters)."""
    ref = weakref.ref(owner)

    def hook(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        return None if target is None else getattr(target, method)(*bound, *args, **kwargs)

    return hook
