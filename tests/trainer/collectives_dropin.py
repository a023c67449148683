"""Scenarios for the drop-in contract: dtypes and ops, torch's exceptions, futures, DDP hooks.

Every scenario compares with torch.distributed's own gloo collectives where gloo takes the call,
and with results computed from torch's where it does not (int16, integer AVG, the dtypes that
only broadcast and all-gather move). See collectives_harness.py for how the worlds are started.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from dtjob.trainer import collectives as C
from tests.trainer.collectives_scenarios import Checker, algorithms, digest, make_input

R = dist.ReduceOp
ALL_OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def _name(op: Any) -> str:
    return str(op).rsplit(".", 1)[-1]


def _ints(seed: int, rank: int, length: int, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000 + rank)
    return torch.randint(low, high, (length,), generator=gen).to(dtype)


def _complex(seed: int, rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    real = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
    pairs = _ints(seed, rank, 2 * length, -8, 9, real[dtype]).view(length, 2)
    return torch.view_as_complex(pairs)


def _random_bytes(seed: int, rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return _ints(seed, rank, length * size, 0, 256, torch.uint8).view(dtype)


def _as_if_coalescing() -> None:
    """Peers takes gloo for a coalescing backend (NCCL's code path: batch_isend_irecv, receives
    posted with their step's sends, dtypes NCCL has no type for sent as bytes)."""
    from dtjob.trainer.collectives.peers import Peers

    Peers._needs_coalescing = lambda self, device: True  # type: ignore[method-assign]


def dtypes_and_ops(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """bool, the small integers, int16, complex, integer AVG and PRODUCT through every algorithm,
    and broadcast / all-gather of dtypes no backend reduces. `arg`: {"coalescing": True} runs it
    on NCCL's code path."""
    if arg and arg.get("coalescing"):
        _as_if_coalescing()
    os.environ["DTJOB_COLLECTIVE_SEGMENT_BYTES"] = "1024"  # many unequal segments per chunk
    check = Checker()
    lengths = (n + 1, 3001)

    def reduce_everywhere(
        key: str, x: torch.Tensor, red: Any, expected: torch.Tensor, rs: bool = True, native: bool = True
    ) -> None:
        for algo in [*algorithms("allreduce", red), "auto"]:
            if algo == "native" and not native:
                continue
            mine = x.clone()
            C.all_reduce(mine, red, algorithm=algo)
            check.same(f"{key}/allreduce/{algo}", mine, expected)
            check.digests[f"{key}/allreduce/{algo}"] = digest(mine)
        if not rs:
            return
        per = x.numel() // n
        for algo in [*algorithms("reduce_scatter", red), "auto"]:
            if algo == "native" and not native:
                continue
            out = torch.empty(per, dtype=x.dtype)
            C.reduce_scatter_tensor(out, x[: per * n], red, algorithm=algo)
            check.same(f"{key}/reduce_scatter/{algo}", out, expected[rank * per : (rank + 1) * per])

    for length in lengths:
        # bool: every op gloo takes, against gloo.
        for red in (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR):
            x = _ints(length, rank, length, 0, 2, torch.bool)
            ref = x.clone()
            dist.all_reduce(ref, red)
            reduce_everywhere(f"bool/{_name(red)}/{length}", x, red, ref)
        # uint8 / int8 / int32: every op, AVG as NCCL computes it (gloo refuses it: from SUM).
        for dtype in (torch.uint8, torch.int8, torch.int32):
            low = 0 if dtype == torch.uint8 else -3
            for red in ALL_OPS:
                x = _ints(length + 1, rank, length, low, 4, dtype)
                ref = x.clone()
                dist.all_reduce(ref, R.SUM if red == R.AVG else red)
                if red == R.AVG:
                    ref = torch.div(ref, n, rounding_mode="trunc")
                reduce_everywhere(f"{dtype}/{_name(red)}/{length}", x, red, ref)
        # int16: gloo has no int16 at all; the reference is gloo's int32 result, narrowed.
        for red in (R.SUM, R.MAX, R.BXOR, R.AVG):
            x = _ints(length + 2, rank, length, -100, 100, torch.int16)
            wide = x.to(torch.int32)
            dist.all_reduce(wide, R.SUM if red == R.AVG else red)
            ref = (torch.div(wide, n, rounding_mode="trunc") if red == R.AVG else wide).to(torch.int16)
            reduce_everywhere(f"int16/{_name(red)}/{length}", x, red, ref, native=False)
        # complex: SUM and AVG, against gloo.
        for dtype in (torch.complex32, torch.complex64, torch.complex128):
            for red in (R.SUM, R.AVG):
                x = _complex(length + 3, rank, length, dtype)
                ref = x.clone()
                dist.all_reduce(ref, red)
                reduce_everywhere(f"{dtype}/{_name(red)}/{length}", x, red, ref, rs=dtype != torch.complex32)
        # PRODUCT of floats, small factors so every product is exact.
        for dtype in (torch.float32, torch.bfloat16):
            x = _ints(length + 4, rank, length, -2, 3, dtype)
            ref = x.clone()
            dist.all_reduce(ref, R.PRODUCT)
            reduce_everywhere(f"{dtype}/PRODUCT/{length}", x, R.PRODUCT, ref)
        # Copies move any dtype: the expected bytes are every rank's (or the root's) input.
        for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.bool):
            mine = (
                _random_bytes(length, rank, length, dtype)
                if dtype != torch.bool
                else make_input(0, rank, length, torch.bool, True)
            )
            everyone = [
                _random_bytes(length, r, length, dtype)
                if dtype != torch.bool
                else make_input(0, r, length, torch.bool, True)
                for r in range(n)
            ]
            want = torch.cat(everyone).view(torch.uint8)
            for algo in [*algorithms("allgather"), "auto"]:
                out = torch.zeros(length * n, dtype=dtype)
                C.all_gather_into_tensor(out, mine, algorithm=algo)
                check.same(f"allgather/{dtype}/{length}/{algo}", out.view(torch.uint8), want)
            for algo in [*algorithms("broadcast"), "auto"]:
                t = mine.clone()
                C.broadcast(t, n - 1, algorithm=algo)
                check.same(
                    f"broadcast/{dtype}/{length}/{algo}", t.view(torch.uint8), everyone[-1].view(torch.uint8)
                )
    # What nobody reduces is refused, naming the dtype, before any message.
    for dtype in (torch.uint32, torch.float8_e4m3fn):
        try:
            C.all_reduce(torch.zeros(4, dtype=dtype))
            check.fail(f"all_reduce of {dtype} must raise")
        except TypeError as error:
            if str(dtype) not in str(error) or not isinstance(error, RuntimeError):
                check.fail(f"{dtype}: {type(error).__name__}: {error}")
    return check.result()


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except Exception as error:
        return error
    return None


def errors_like_torch(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """For each misuse, torch (gloo) raises; dtjob raises an instance of the same class, of what
    torch's NCCL backend raises for it, with a message naming the argument."""
    check = Checker()
    e = torch.empty
    complex_ones = torch.ones(3, dtype=torch.complex64)
    cases: list[tuple[str, Callable[[], object], Callable[[], object], type[BaseException], str]] = [
        (
            "reduce_scatter sizes",
            lambda: dist.reduce_scatter_tensor(e(3), e(3 * n + 1)),
            lambda: C.reduce_scatter_tensor(e(3), e(3 * n + 1)),
            ValueError,
            f"world_size ({n})",
        ),
        (
            "all_gather sizes",
            lambda: dist.all_gather_into_tensor(e(2 * n + 1), e(2)),
            lambda: C.all_gather_into_tensor(e(2 * n + 1), e(2)),
            ValueError,
            "output_tensor",
        ),
        (
            "all_gather dtypes",
            lambda: dist.all_gather_into_tensor(e(2 * n), e(2, dtype=torch.int64)),
            lambda: C.all_gather_into_tensor(e(2 * n), e(2, dtype=torch.int64)),
            TypeError,
            "dtype",
        ),
        (
            "reduce_scatter dtypes",
            lambda: dist.reduce_scatter_tensor(e(2), e(2 * n, dtype=torch.int64)),
            lambda: C.reduce_scatter_tensor(e(2), e(2 * n, dtype=torch.int64)),
            TypeError,
            "dtype",
        ),
        (
            "not a tensor",
            lambda: dist.all_reduce(cast(torch.Tensor, [1.0])),
            lambda: C.all_reduce(cast(torch.Tensor, [1.0])),
            TypeError,
            "torch.Tensor",
        ),
        (
            "complex MAX",
            lambda: dist.all_reduce(complex_ones.clone(), R.MAX),
            lambda: C.all_reduce(complex_ones.clone(), R.MAX),
            ValueError,
            "complex",
        ),
        (
            "float BAND",
            lambda: dist.all_reduce(torch.ones(3), R.BAND),
            lambda: C.all_reduce(torch.ones(3), R.BAND),
            ValueError,
            "BAND",
        ),
        (
            "bool AVG",
            lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), R.AVG),
            lambda: C.all_reduce(torch.ones(3, dtype=torch.bool), R.AVG),
            TypeError,
            "AVG",
        ),
        (
            "broadcast src and group_src",
            lambda: dist.broadcast(torch.ones(3), 0, group_src=0),
            lambda: C.broadcast(torch.ones(3), 0, group_src=0),
            ValueError,
            "group_src",
        ),
        (
            "broadcast without a source",
            lambda: dist.broadcast(torch.ones(3)),
            lambda: C.broadcast(torch.ones(3)),
            ValueError,
            "src",
        ),
        (
            "broadcast group_src outside",
            lambda: dist.broadcast(torch.ones(3), group_src=n + 2),
            lambda: C.broadcast(torch.ones(3), group_src=n + 2),
            ValueError,
            "group_src",
        ),
        (
            "broadcast src outside",
            lambda: dist.broadcast(torch.ones(3), n + 2),
            lambda: C.broadcast(torch.ones(3), n + 2),
            ValueError,
            "src",
        ),
        (
            "group not a group",
            lambda: dist.all_reduce(torch.ones(3), group=cast(dist.ProcessGroup, 5)),
            lambda: C.all_reduce(torch.ones(3), group=cast(dist.ProcessGroup, 5)),
            ValueError,
            "group",
        ),
        (
            "op not an op",
            lambda: dist.all_reduce(torch.ones(3), cast(dist.ReduceOp, "sum")),
            lambda: C.all_reduce(torch.ones(3), cast(dist.ReduceOp, "sum")),
            TypeError,
            "op",
        ),
    ]
    for label, theirs, ours, nccl_class, words in cases:
        torch_error, our_error = _raised(theirs), _raised(ours)
        check.cases += 1
        if torch_error is None:
            check.fail(f"{label}: torch did not raise (the case tests nothing)")
        elif our_error is None:
            check.fail(f"{label}: dtjob did not raise ({type(torch_error).__name__} from torch)")
        elif not isinstance(our_error, type(torch_error)) or not isinstance(our_error, nccl_class):
            check.fail(
                f"{label}: dtjob raised {type(our_error).__mro__[:3]}, torch {type(torch_error).__name__}"
                f" (and NCCL {nccl_class.__name__})"
            )
        elif words not in str(our_error):
            check.fail(f"{label}: the message does not mention {words!r}: {our_error}")
    # A sparse tensor: torch's gloo all-reduces it; dtjob refuses it clearly, for every op.
    sparse = torch.eye(3).to_sparse()
    for label, call in (
        ("all_reduce", lambda: C.all_reduce(sparse.clone())),
        ("broadcast", lambda: C.broadcast(sparse.clone(), 0)),
        ("all_gather", lambda: C.all_gather_into_tensor(e(3 * n), sparse.clone())),
        ("reduce_scatter", lambda: C.reduce_scatter_tensor(e(3), sparse.clone())),
    ):
        check.cases += 1
        error = _raised(call)
        if not isinstance(error, ValueError) or "sparse" not in str(error) or "to_dense" not in str(error):
            check.fail(f"sparse {label}: expected a ValueError naming sparse and to_dense, got {error!r}")
    # Everything still works after the refusals: nothing was sent.
    x = torch.full((5,), float(rank))
    C.all_reduce(x)
    check.same("after the errors", x, torch.full((5,), float(sum(range(n)))))
    return check.result()


def futures(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """Async handles: get_future()'s value is [output] (the very tensor), then() chains, wait()
    and synchronize() work, for dtjob's algorithms and native alike, queued or finished."""
    check = Checker()
    total = float(sum(range(n)))
    for algo in ("ring", "hd", "native", "auto"):
        x = torch.full((1000,), float(rank))
        work = C.all_reduce(x, async_op=True, algorithm=algo)
        assert work is not None
        doubled = work.get_future().then(lambda f: f.value()[0] * 2)
        value = work.get_future().wait()
        check.cases += 1
        if not (isinstance(value, list) and len(value) == 1 and value[0] is x):
            check.fail(f"{algo}: all_reduce's future holds {value!r}, not [tensor]")
        check.same(f"{algo}/then", doubled.wait(), torch.full((1000,), 2 * total))
        work.synchronize()
        if not work.is_completed() or not work.is_success() or work.exception() is not None:
            check.fail(f"{algo}: a finished work must say so")
        out = torch.empty(7)
        work = C.reduce_scatter_tensor(out, torch.ones(7 * n), async_op=True, algorithm=algo)
        assert work is not None
        got = work.get_future().wait()
        check.cases += 1
        if got[0] is not out:
            check.fail(f"{algo}: reduce_scatter's future must hold the output")
        check.same(f"{algo}/reduce_scatter", out, torch.full((7,), float(n)))
        gathered = torch.empty(3 * n)
        work = C.all_gather_into_tensor(
            gathered, torch.full((3,), float(rank)), async_op=True, algorithm=algo
        )
        assert work is not None
        check.cases += 1
        if work.get_future().wait()[0] is not gathered:
            check.fail(f"{algo}: all_gather's future must hold the output")
        bcast = torch.full((4,), float(rank))
        b_algo = "tree" if algo == "hd" else algo
        work = C.broadcast(bcast, None, None, True, n - 1, algorithm=b_algo)  # torch's positional group_src
        assert work is not None
        check.same(f"{b_algo}/broadcast", work.get_future().wait()[0], torch.full((4,), float(n - 1)))
    # Futures of calls still queued, collected together.
    bufs = [torch.full((1 << 18,), float(rank + i)) for i in range(4)]
    works = [C.all_reduce(b, async_op=True, algorithm="ring") for b in bufs]
    all_done = torch.futures.collect_all([w.get_future() for w in works if w is not None])
    all_done.wait()
    for i, b in enumerate(bufs):
        check.same(f"queued {i}", b, torch.full((1 << 18,), total + n * i))
    if C.all_reduce(torch.ones(2)) is not None:
        check.fail("a synchronous call returns None, as torch's")
    return check.result()


def _dyadic_model(seed: int) -> nn.Module:
    """Weights that are small multiples of 1/8: with two ranks every sum is exact in any order."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-4, 5, p.shape) / 8)
    return model


def ddp_hook(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """torch's DistributedDataParallel with a communication hook calling dtjob's all_reduce and
    its get_future(), against the same DDP with torch's own all-reduce in the hook, for several
    steps: with two ranks bitwise equal, with more within float rounding; on every rank the same."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    check = Checker()

    def hook_with(algorithm: str | None) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        # No annotations: DDP compares them with dist.GradBucket, and under `from __future__
        # import annotations` they are strings.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer().div_(n)  # as torch's allreduce_hook: divide, then sum
            if algorithm is None:
                work = dist.all_reduce(buf, async_op=True)
            else:
                work = C.all_reduce(buf, async_op=True, algorithm=algorithm)
            assert work is not None
            return work.get_future().then(lambda fut: fut.value()[0])

        return hook

    torch_ddp = DDP(_dyadic_model(0), bucket_cap_mb=0.0005)  # ~500 bytes: several buckets
    torch_ddp.register_comm_hook(None, hook_with(None))
    runs = {}
    for algorithm in ("ring", "hd", "direct", "native", "auto"):
        model = DDP(_dyadic_model(0), bucket_cap_mb=0.0005)
        model.register_comm_hook(None, hook_with(algorithm))
        runs[algorithm] = model
    models = {"torch": torch_ddp, **runs}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.0625) for k, m in models.items()}
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(-3, 4, (8, 12), generator=gen).float()
        y = torch.randint(-3, 4, (8, 3), generator=gen).float()
        for key, model in models.items():
            optimizers[key].zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizers[key].step()
        ref = [p.detach() for p in torch_ddp.parameters()]
        for key in runs:
            mine = [p.detach() for p in runs[key].parameters()]
            for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
                label = f"step {step}/{key}/param {i}"
                if n == 2:
                    check.same(label, a, b)
                else:
                    check.close(label, a, b, 1e-5 * (b.abs() + 1))
                check.digests[label] = digest(a)
    return check.result()


def native_everywhere(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """auto counts native among its candidates for every op and size, and keeps a correct result
    whichever wins; with trials off the model decides, native included."""
    from dtjob.trainer.collectives.tuning import call_kind
    from dtjob.trainer.collectives.work import runner_for

    check = Checker()
    os.environ["DTJOB_COLLECTIVE_TRIALS"] = "4"
    candidates: dict[str, list[str]] = {}
    for length in (1024, 1 << 18):  # 4 KiB and 1 MiB of float32 per rank
        for i in range(24):
            x = make_input(i, rank, length, torch.float32, True)
            ref = x.clone()
            dist.all_reduce(ref)
            C.all_reduce(x)
            check.same(f"allreduce/{length}/{i}", x, ref)
            inp = make_input(i, rank, length * n, torch.float32, True)
            out, ref_out = torch.empty(length), torch.empty(length)
            dist.reduce_scatter_tensor(ref_out, inp)
            C.reduce_scatter_tensor(out, inp)
            check.same(f"reduce_scatter/{length}/{i}", out, ref_out)
            gathered, ref_all = torch.empty(length * n), torch.empty(length * n)
            dist.all_gather_into_tensor(ref_all, x)
            C.all_gather_into_tensor(gathered, x)
            check.same(f"allgather/{length}/{i}", gathered, ref_all)
            t = make_input(i, rank, length, torch.float32, True)
            C.broadcast(t, 0)
            check.same(f"broadcast/{length}/{i}", t, make_input(i, 0, length, torch.float32, True))
        runner = runner_for(cast(dist.ProcessGroup, dist.group.WORLD))
        for op, whole in (("allreduce", length), ("reduce_scatter", length * n), ("allgather", length * n)):
            kind = call_kind(op, whole * 4, "float32")
            candidates[f"{op}/{length}"] = list(runner.trials[kind].candidates)
        candidates[f"broadcast/{length}"] = list(
            runner.trials[call_kind("broadcast", length * 4, "float32")].candidates
        )
    os.environ["DTJOB_COLLECTIVE_TRIALS"] = "0"
    for length in (3, 1 << 16):
        x = torch.full((length,), float(rank), dtype=torch.float64)
        C.all_reduce(x)
        check.same(
            f"model only/{length}", x, torch.full((length,), float(sum(range(n))), dtype=torch.float64)
        )
    del os.environ["DTJOB_COLLECTIVE_TRIALS"]
    return {**check.result(), "candidates": candidates}


def destroyed_groups(rank: int, n: int, arg: Any) -> dict[str, Any]:
    """A group's runner, caches and worker thread go with the group: destroy_process_group() and
    dropping the last reference are enough (nothing to call in dtjob's collectives)."""
    import gc
    import threading
    import weakref

    from dtjob.trainer.collectives import work as work_module

    check = Checker()

    def collective_threads() -> int:
        return sum(t.name.startswith("dtjob-collectives-") for t in threading.enumerate())

    before = collective_threads()
    group = cast(dist.ProcessGroup, dist.new_group(list(range(n))))
    x = torch.full((1000,), float(rank))
    handle = C.all_reduce(x, group=group, async_op=True, algorithm="ring")  # starts its worker thread
    assert handle is not None
    handle.wait()
    check.same("subgroup result", x, torch.full((1000,), float(sum(range(n)))))
    gone = weakref.ref(work_module.runner_for(group))
    if collective_threads() != before + 1:
        check.fail(f"expected one more worker thread, found {collective_threads()} after {before}")
    dist.destroy_process_group(group)
    del group, handle
    gc.collect()
    for _ in range(50):  # the finalizer asks the thread to stop; give it a moment
        if collective_threads() == before:
            break
        threading.Event().wait(0.1)
    check.cases += 1
    if collective_threads() != before:
        check.fail("the destroyed group's worker thread is still running")
    if gone() is not None:
        check.fail("the destroyed group's runner is still alive")
    # The default group is unaffected.
    y = torch.ones(3)
    C.all_reduce(y)
    check.same("world after", y, torch.full((3,), float(n)))
    return check.result()
