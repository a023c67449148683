"""The torch surface (issue #40): each method of torch's DDP and FSDP2 that users call either works
on dtjob's wrappers or raises a NotImplementedError that names the alternative, never an
AttributeError about the wrapped module. One real 2-rank gloo group runs every (wrapper, method)
check; the table below is the README's ("The torch surface")."""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dtjob.trainer.models import MLP, MLPConfig
from dtjob.trainer.parallel import data_parallel, fully_shard, pipeline
from tests.trainer.runtime_gang import free_port

WORLD = 2
WRAPPERS = ["data_parallel", "fully_shard-1", "fully_shard-3", "pipeline"]
METHODS = [
    "no_sync",
    "set_requires_gradient_sync",
    "register_comm_hook",
    "join",
    "set_reshard_after_forward",
    "unshard",
    "reshard",
    "state_dict/load_state_dict",
    "named_parameters",
    "train/eval",
    "to",
    "zero_grad",
    "clip_grad_norm_",
]
_SHARDING = {"set_reshard_after_forward", "unshard", "reshard"}
UNSUPPORTED = {
    "data_parallel": {"register_comm_hook", "join", *_SHARDING},
    "fully_shard-1": {"register_comm_hook", "join", "set_reshard_after_forward"},
    "fully_shard-3": {"register_comm_hook", "join", "set_reshard_after_forward"},
    "pipeline": {"no_sync", "set_requires_gradient_sync", "register_comm_hook", "join", *_SHARDING},
}
CONFIG = MLPConfig(inputs=12, hidden=24, classes=6, depth=4)
BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(CONFIG)


def _wrap(kind: str) -> Any:
    if kind == "data_parallel":
        return data_parallel(_model())
    if kind.startswith("fully_shard"):
        return fully_shard(_model(), zero_stage=int(kind[-1]))
    return pipeline(_model(), stages=WORLD, microbatches=2)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(BATCH, CONFIG.inputs, generator=g)
    return inputs, torch.randint(0, CONFIG.classes, (BATCH,), generator=g)


def _backward(model: Any, kind: str, seed: int) -> None:
    x, y = _batch(seed)
    if kind == "pipeline":
        model.step(x, y)
    else:
        F.cross_entropy(model(x), y).backward()


def _grads(model: Any) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert (x is None) == (y is None), name
        if x is not None and y is not None:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7, msg=name)


def _accumulate(kind: str, persistent: bool) -> dict[str, torch.Tensor | None]:
    """Two local micro-steps (different data per rank), then one that reduces: through no_sync()
    or through set_requires_gradient_sync(False/True)."""
    model = _wrap(kind)
    rank = dist.get_rank()
    if persistent:
        model.set_requires_gradient_sync(False)
        _backward(model, kind, 10 + rank)
        _backward(model, kind, 20 + rank)
        if kind == "data_parallel":  # nothing reduced yet: the ranks' gradients differ
            mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            everyone = [torch.empty_like(mine) for _ in range(WORLD)]
            dist.all_gather(everyone, mine)
            assert not torch.equal(everyone[0], everyone[1])
        model.set_requires_gradient_sync(True)
    else:
        for seed in (10 + rank, 20 + rank):
            with model.no_sync():
                _backward(model, kind, seed)
    _backward(model, kind, 30 + rank)
    return _grads(model)


def check_sync(kind: str) -> None:
    _same(_accumulate(kind, persistent=True), _accumulate(kind, persistent=False))


def check_state_dict(kind: str) -> None:
    model = _wrap(kind)
    names = set(_model().state_dict())
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert saved and set(saved) <= names
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(saved)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=k)


def check_named_parameters(kind: str) -> None:
    model = _wrap(kind)
    mine = [n for n, _ in model.named_parameters()]
    everyone: list[Any] = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    want = {n for n, _ in _model().named_parameters()}
    assert set(mine) <= want
    if kind == "pipeline":  # each stage its own; together the whole model
        assert set().union(*everyone) == want
    else:
        assert set(mine) == want


def check_train_eval(kind: str) -> None:
    model = _wrap(kind)
    model.eval()
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def check_to(kind: str) -> None:
    model = _wrap(kind)
    assert model.to("cpu") is model and model.to(torch.float32) is model  # where it is: a no-op
    with pytest.raises(NotImplementedError, match="before wrapping"):
        model.to(torch.float64)


def check_zero_grad(kind: str) -> None:
    model = _wrap(kind)
    _backward(model, kind, 1)
    first = _grads(model)
    assert any(g is not None and g.abs().sum() > 0 for g in first.values())
    model.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    _backward(model, kind, 1)  # the same batch, the same parameters: the same gradients again
    _same(_grads(model), first)
    model.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    _backward(model, kind, 1)
    _same(_grads(model), first)


def check_clip(kind: str) -> None:
    """The total norm over every rank's pieces is the one-process norm (the same batch on every
    rank, so the averaged gradients are the one-process gradients)."""
    model = _wrap(kind)
    _backward(model, kind, 5)
    got = model.clip_grad_norm_(1e9)
    reference = _model()
    x, y = _batch(5)
    F.cross_entropy(reference(x), y).backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters() if p.grad is not None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def _call_unsupported(kind: str, method: str) -> None:
    model = _wrap(kind)
    calls: dict[str, Callable[[], Any]] = {
        "no_sync": lambda: model.no_sync(),
        "set_requires_gradient_sync": lambda: model.set_requires_gradient_sync(False),
        "register_comm_hook": lambda: model.register_comm_hook(None, lambda state, bucket: bucket),
        "join": lambda: model.join(),
        "set_reshard_after_forward": lambda: model.set_reshard_after_forward(False),
        "unshard": lambda: model.unshard(),
        "reshard": lambda: model.reshard(),
    }
    try:
        calls[method]()
    except NotImplementedError as err:
        text = str(err)
        assert f"{method}()" in text and "dtjob" in text and ";" in text, text  # names the alternative
        return
    raise AssertionError(f"{kind}.{method}() raised nothing")


def check_unshard(kind: str) -> None:
    """unshard(): the wrapped module holds the full parameters (rank 0's, broadcast when
    wrapping: _model()'s) until reshard() registers the 1-D shards again."""
    model = _wrap(kind)
    want = dict(_model().named_parameters())
    model.unshard()
    for name, p in model.module.named_parameters():
        torch.testing.assert_close(p.detach(), want[name].detach(), rtol=0, atol=0, msg=name)
    model.reshard()
    assert all(isinstance(p, DTensor) for p in model.module.parameters())  # the shards again


CHECKS: dict[str, Callable[[str], None]] = {
    "no_sync": check_sync,
    "set_requires_gradient_sync": check_sync,
    "state_dict/load_state_dict": check_state_dict,
    "named_parameters": check_named_parameters,
    "train/eval": check_train_eval,
    "to": check_to,
    "zero_grad": check_zero_grad,
    "clip_grad_norm_": check_clip,
    "unshard": check_unshard,
    "reshard": check_unshard,
}


def _worker(rank: int, port: int, results: multiprocessing.Queue[Any]) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    out: dict[tuple[str, str], str] = {}
    for kind in WRAPPERS:
        for method in METHODS:
            try:
                if method in UNSUPPORTED[kind]:
                    _call_unsupported(kind, method)
                else:
                    CHECKS[method](kind)
                out[kind, method] = "ok"
            except BaseException:
                out[kind, method] = traceback.format_exc()
    results.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def surface() -> list[dict[tuple[str, str], str]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [got[r] for r in range(WORLD)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_torch_method_works_or_names_the_alternative(
    surface: list[dict[tuple[str, str], str]], wrapper: str, method: str
) -> None:
    for rank, out in enumerate(surface):
        assert out[wrapper, method] == "ok", f"rank {rank}: {out[wrapper, method]}"
