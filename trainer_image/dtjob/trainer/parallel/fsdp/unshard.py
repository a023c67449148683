"""fully_shard's full parameters outside a training step: the user's own methods and submodules
reached through the wrapper, and FSDP2's `unshard()` / `reshard()`.

    tokens = model.generate(ids, max_new_tokens=8)     # a method of the wrapped model
    encoder = model.get_encoder()                      # a submodule, usable later
    with torch.no_grad():
        hidden = encoder(input_ids=ids).last_hidden_state
    model.unshard(); ...; model.reshard()              # or: with model.summon_full_params(): ...

Between steps the wrapped module holds this rank's 1-D shards. A *scope* makes it runnable as a
no-grad forward does: the full parameters registered (ZeRO-1/2: the shards the optimizer changed
gathered); ZeRO-3: the root unit gathered, and each block unit gathered by its forward hooks and
freed after, so a generate() holds what a forward holds. At ZeRO-3 a block unit's parameters are
registered only while it is gathered, meta tensors of their shapes otherwise: shapes read right
(num_parameters()), values read outside the unit's forward raise instead of crashing on the freed
buffer (use unshard() or full_state_dict(model) for them). When the scope ends the shards are
registered again and (ZeRO-3) every gathered unit freed. Scopes open:
- around a method of the wrapped model or of any submodule, reached through the wrapper
  (`model.generate`, `model.get_input_embeddings`); with gradients enabled a method whose result
  needs a backward leaves the step open for it, as forward does;
- around a call, outside a step, of a submodule reached through the wrapper (an attribute, or
  what such a method returns, and every module inside it) and of every unit: under
  torch.no_grad() only (training goes through the wrapper's forward, where backward reduces the
  gradients);
- from unshard() (ZeRO-3: gathering every unit) until reshard().
A scope gathers with collectives: every rank makes the same calls (as with FSDP2's unshard()).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtjob.trainer.parallel import common

if TYPE_CHECKING:
    from dtjob.trainer.parallel.fsdp.flat import FlatUnit


class _Done:
    """What unshard(async_op=True) returns: the gather already finished, wait() has nothing to do."""

    def wait(self) -> None:
        return None


class Unsharding:
    """The scope machinery of FullyShardedModule (a base class of it; see the module docstring)."""

    if TYPE_CHECKING:
        module: nn.Module
        stage: int
        units: list[FlatUnit]
        mixed_precision: str | None
        _step_open: bool
        _registrations: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]]

        def _open_step(self, grad: bool) -> None: ...
        def _close_step(self) -> None: ...
        def _gather(self, unit: FlatUnit) -> None: ...

    def _init_unsharding(self, unit_modules: list[tuple[FlatUnit, nn.Module]]) -> None:
        self._unsharded = False  # unshard() holds the full parameters until reshard()
        self._scopes: list[contextlib.ExitStack | None] = []  # one per hooked call running
        self._module_ids = {id(m) for m in self.module.modules()}
        self._scope_hooked: set[int] = set()
        self._reached: set[int] = set()  # modules whose whole subtree has the scope hooks
        # ZeRO-3, in a scope's step: a block unit's parameters are registered while it runs; meta
        # stand-ins of their shapes otherwise, so code reading them outside the unit's forward
        # fails (meta tensors have no data) instead of reading the freed full buffer (a crash).
        self._lazy_units = False
        unit_of_param = {id(s.param): unit.index for unit, _ in unit_modules for s in unit.slots}
        self._unit_registrations: dict[int, list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]]] = {}
        for sub, attr, full, _piece in self._registrations:
            index = unit_of_param.get(id(full))
            if index is not None:
                meta = nn.Parameter(torch.empty_like(full, device="meta"), requires_grad=full.requires_grad)
                self._unit_registrations.setdefault(index, []).append((sub, attr, full, meta))
        # Every module inside a block unit (the unit too): that unit's index.
        self._unit_of = {id(m): unit.index for unit, sub in unit_modules for m in sub.modules()}
        for unit, sub in unit_modules:
            self._hook_scope(sub, f"unit {unit.label}")

    # -- FSDP2's surface ---------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> _Done | None:
        """Register and gather the full parameters until reshard(), as FSDP2: for inference and
        inspection. No-grad forwards run on them; a forward with gradients is refused until
        reshard(). They are a read-only snapshot: reshard() drops them without writing changes back,
        so do not step the optimizer in between."""
        if not self._unsharded:
            if self._step_open:
                raise RuntimeError(
                    "fully_shard: unshard() between a forward and its backward; call it after the backward"
                )
            self._open_step(False)
            for unit in self.units:
                self._gather(unit)  # ZeRO-3; ZeRO-1/2 hold the full parameters already
            self._unsharded = True
        return _Done() if async_op else None

    def reshard(self) -> None:
        """Back to the shards (ZeRO-3: the gathered parameters freed); a no-op if not unsharded."""
        if self._unsharded:
            self._unsharded = False
            self._close_step()

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """unshard() for the duration of the block (read-only, as unshard())."""
        was = self._unsharded
        self.unshard()
        try:
            yield
        finally:
            if not was:
                self.reshard()

    def _refuse_training_while_unsharded(self) -> None:
        if self._unsharded and torch.is_grad_enabled():
            raise RuntimeError(
                "fully_shard: a forward with gradients while unshard() holds the full parameters; call "
                "model.reshard() first (unshard() is for inference and inspection, under torch.no_grad())"
            )

    def _open_scope(self, grad: bool) -> None:
        """A step for a call outside the wrapper's forward (ZeRO-3: units registered lazily)."""
        self._open_step(grad)
        if self.stage == 3:
            self._lazy_units = True
            for index in self._unit_registrations:
                self._register_unit(index, full=False)

    def _register_unit(self, index: int, full: bool) -> None:
        for sub, attr, param, meta in self._unit_registrations.get(index, []):
            sub._parameters[attr] = param if full else meta

    # -- what the wrapper's __getattr__ hands out --------------------------------------------------
    def _forwarded(self, value: Any) -> Any:
        """A method of the wrapped model (or a submodule's) runs in a scope; a submodule and every
        module inside it get the scope hooks for calls made later."""
        if isinstance(value, nn.Module):
            if id(value) in self._module_ids and id(value) not in self._reached:
                self._reached.add(id(value))
                for sub in value.modules():
                    self._hook_scope(sub, type(sub).__name__)
            return value
        owner = getattr(value, "__self__", None)
        if inspect.ismethod(value) and isinstance(owner, nn.Module) and id(owner) in self._module_ids:
            return self._in_scope(value)
        return value

    def _in_scope(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            grad = torch.is_grad_enabled()
            opened = not self._step_open
            if opened:
                self._open_scope(grad)
            try:
                with common.autocast(self.mixed_precision, self.units[0].device):
                    out = method(*args, **kwargs)
            except BaseException:
                if opened:
                    self._close_step()
                raise
            # As forward: a result that needs a backward keeps the step open; backward closes it.
            if opened and not (grad and any(t.requires_grad for t in common.tensors_in(out))):
                self._close_step()
            return self._forwarded(out)

        return call

    # -- scope hooks on submodules -----------------------------------------------------------------
    def _hook_scope(self, module: nn.Module, label: str) -> None:
        if id(module) in self._scope_hooked:
            return
        self._scope_hooked.add(id(module))
        # First of the pre-hooks (a unit's own gathers after it); the post-hook runs after the
        # unit's (which frees it) and also when the forward raises.
        module.register_forward_pre_hook(common.weak_hook(self, "_scope_pre_hook", label), prepend=True)
        module.register_forward_hook(common.weak_hook(self, "_scope_post_hook"), always_call=True)

    def _scope_pre_hook(self, label: str, module: nn.Module, args: Any) -> None:
        self._scopes.append(None)  # first: the post-hook pops it even if this raises
        if not self._step_open:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"fully_shard: {label} ran outside the wrapped model's forward with gradients enabled; "
                    "to train, call the module fully_shard returned (model(...)), whose backward reduces "
                    "the gradients; for inference, run it under torch.no_grad()"
                )
            scope = contextlib.ExitStack()
            self._open_scope(False)
            scope.callback(self._close_step)
            scope.enter_context(common.autocast(self.mixed_precision, self.units[0].device))
            self._scopes[-1] = scope
        index = self._unit_of.get(id(module))
        if self._lazy_units and index is not None:
            self._gather(self.units[index])  # a module inside the unit, called on its own: gathered here
            self._register_unit(index, full=True)

    def _scope_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        scope = self._scopes.pop()
        index = self._unit_of.get(id(module))
        if self._lazy_units and index is not None and not self.units[index].gathered:
            self._register_unit(index, full=False)  # the unit's own hook freed it
        if scope is not None:
            scope.close()
