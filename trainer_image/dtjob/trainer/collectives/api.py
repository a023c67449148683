"""The four collectives, with torch.distributed's signatures plus `algorithm=`.

Each call validates its arguments in the caller (torch's exception classes, before any message is
sent), decides which algorithm runs it (the keyword, DTJOB_COLLECTIVE_ALGO, or auto: cost model
and trials), then either issues the backend's own collective at once ("native", native.py) or
hands a job to the group's runner (work.py), which runs dtjob's algorithms in call order.
Auto decides in the caller's thread: every rank makes the same calls in the same order, so the
ranks decide alike; the collective steps auto needs itself (calibration, the trials' agreement)
run after the group's queued calls, at the same call on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dtjob.trainer.collectives import (
    abort,
    direct,
    halving_doubling,
    hierarchical,
    native,
    ring,
    selection,
    tuning,
)
from dtjob.trainer.collectives import broadcast as broadcast_algos
from dtjob.trainer.collectives.calibration import cost_model, same_everywhere
from dtjob.trainer.collectives.errors import InvalidArgument, InvalidType
from dtjob.trainer.collectives.hierarchical import PodLayout
from dtjob.trainer.collectives.peers import Peers
from dtjob.trainer.collectives.reduce_ops import RedOpType, ReduceOpLike, Reduction, check_op, op_kind
from dtjob.trainer.collectives.selection import HIER, NATIVE
from dtjob.trainer.collectives.work import CollectiveWork, GroupRunner, runner_for

ProcessGroup = dist.ProcessGroup

# dtjob's own algorithms of each op by name (selection.ALGORITHMS adds "hier" and "native").
_ALL_REDUCE = {
    "ring": ring.all_reduce,
    "hd": halving_doubling.all_reduce,
    "rd": halving_doubling.recursive_doubling_all_reduce,
    "direct": direct.all_reduce,
}
_REDUCE_SCATTER = {
    "ring": ring.reduce_scatter,
    "hd": halving_doubling.reduce_scatter,
    "direct": direct.reduce_scatter,
}
_ALL_GATHER = {"ring": ring.all_gather, "hd": halving_doubling.all_gather, "direct": direct.all_gather}
_BROADCAST = {
    "tree": broadcast_algos.tree,
    "ring": broadcast_algos.scatter_ring,
    "hd": broadcast_algos.scatter_doubling,
}


def _group(group: ProcessGroup | None, name: str) -> ProcessGroup | None:
    """The process group to use, or None when this rank is not a member (torch returns None then)."""
    if not dist.is_initialized():
        raise RuntimeError(f"{name}: torch.distributed is not initialized; call init_process_group() first")
    if group is None:
        world = dist.group.WORLD
        assert isinstance(world, ProcessGroup)
        return world
    if not isinstance(group, ProcessGroup) and group == dist.GroupMember.NON_GROUP_MEMBER:
        return None  # what new_group() hands a rank outside the group
    if not isinstance(group, ProcessGroup):
        raise ValueError(f"{name}: group must be a ProcessGroup from new_group() or None, got {group!r}")
    return group


def _check_tensor(name: str, arg: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InvalidArgument(
            f"{name}: {arg} is a sparse tensor (layout={tensor.layout}); dtjob's collectives take dense "
            f"tensors: pass {arg}.to_dense(), or reduce its values() and indices() as dense tensors"
        )
    return tensor


def _check_pair(name: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise InvalidType(f"{name}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise InvalidArgument(f"{name}: output is on {output.device} but input is on {input.device}")


@dataclass
class _Call:
    """What the decision needs to know about one call."""

    op: str  # selection's name: "allreduce", "reduce_scatter", "allgather", "broadcast"
    name: str  # torch's name, for messages
    runner: GroupRunner
    device: torch.device
    dtype: torch.dtype
    nbytes: int  # the whole vector
    kind: RedOpType | None  # None for the copies (all-gather, broadcast)
    reduction: Reduction | None  # None where dtjob's algorithms cannot reduce it ...
    refusal: Exception | None  # ... and why
    local_world_size: int | None = None  # all_reduce's keyword

    @classmethod
    def of(
        cls,
        op: str,
        name: str,
        runner: GroupRunner,
        whole: torch.Tensor,
        reduced: tuple[RedOpType, Reduction | None, Exception | None] | None = None,
    ) -> _Call:
        """The call that moves `whole` (the full vector: all-gather's output, reduce-scatter's
        input); `reduced` is _reduction's answer for the reducing ops, None for the copies."""
        kind, reduction, refusal = reduced if reduced is not None else (None, None, None)
        nbytes = whole.numel() * whole.element_size()
        return cls(op, name, runner, whole.device, whole.dtype, nbytes, kind, reduction, refusal)

    @property
    def backend(self) -> str:
        key = f"backend:{self.device.type}"
        name = self.runner.cache.get(key)
        if not isinstance(name, str):
            name = self.runner.cache[key] = native.backend_name(self.runner.group, self.device)
        return name

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def pods(self, agreed_only: bool) -> PodLayout | str:
        """The group's pod layout for hier, or why there is none. With `agreed_only`, a
        LOCAL_WORLD_SIZE from the environment counts only once every rank has been seen to hold
        the same value (auto's calibration checks it)."""
        local = hierarchical.local_world_size(self.local_world_size)
        if agreed_only and self.local_world_size is None:
            agreed = self.runner.cache.get(f"local_world_size:{self.device.type}")
            if agreed != local:
                return f"LOCAL_WORLD_SIZE={local} is not the same on every rank"
        key = f"pods:{local}"
        if key not in self.runner.cache:
            self.runner.cache[key] = hierarchical.pod_layout(self.runner.global_ranks, local)
        layout = self.runner.cache[key]
        assert isinstance(layout, PodLayout | str)
        return layout


def _reduction(
    op: ReduceOpLike, dtype: torch.dtype, name: str
) -> tuple[RedOpType, Reduction | None, Exception | None]:
    """The op's kind (torch-wide rules checked: they raise), and dtjob's reduction or why not."""
    kind = op_kind(op, name)
    check_op(kind, dtype, name)
    try:
        return kind, Reduction(op, dtype, name), None
    except (InvalidArgument, InvalidType) as refusal:
        return kind, None, refusal


def _offered(call: _Call, for_auto: bool) -> tuple[str, ...]:
    """The algorithms that can run this call (remembered per kind of call: it runs on every one)."""
    local = hierarchical.local_world_size(call.local_world_size) if call.op == "allreduce" else 0
    key = (call.op, call.dtype, call.kind, call.device.type, local, call.local_world_size, for_auto)
    known = call.runner.offered.get(key)
    if known is None:
        known = call.runner.offered[key] = _find_offered(call, for_auto)
    return known


def _find_offered(call: _Call, for_auto: bool) -> tuple[str, ...]:
    found = []
    for algorithm in selection.ALGORITHMS[call.op]:
        if algorithm == NATIVE:
            ok = native.accepts(call.backend, call.kind, call.dtype)
        elif algorithm == HIER:
            ok = isinstance(call.pods(agreed_only=for_auto), PodLayout)
        else:
            ok = call.kind is None or call.reduction is not None
        if ok:
            found.append(algorithm)
    return tuple(found)


def _refuse(call: _Call, algorithm: str) -> None:
    """Raise why `algorithm` cannot run the call, if it cannot (before any message is sent)."""
    if algorithm == NATIVE:
        return  # the backend decides, and raises its own error
    if algorithm == HIER:
        layout = call.pods(agreed_only=False)
        if not isinstance(layout, PodLayout):
            raise InvalidArgument(
                f"{call.name}: algorithm='hier' needs a group spanning several worker pods with the same "
                f"number (at least 2) of its members in each; this group has {layout}. Use another "
                "algorithm, or pass local_world_size= if LOCAL_WORLD_SIZE does not describe the pods"
            )
        return
    if call.refusal is not None:
        raise call.refusal


def _peers(runner: GroupRunner, tag: int, device: torch.device) -> Peers:
    stream_key = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return Peers(
        runner.group,
        tag,
        scratch_pool=runner.scratch_pool,
        global_ranks=runner.global_ranks,
        stream_key=stream_key,
    )


def _calibrate(call: _Call) -> selection.CostModel:
    """The group's cost model for the call's device type, measured once with the agreement on
    LOCAL_WORLD_SIZE (both collective: every rank's first auto call on the group gets here)."""
    runner, device = call.runner, call.device
    model = runner.cache.get(f"cost_model:{device.type}")
    if isinstance(model, selection.CostModel):
        return model
    local = hierarchical.local_world_size(None)

    def measure(tag: int) -> str:
        peers = _peers(runner, tag, device)
        cost_model(runner, peers, device)
        agreed = same_everywhere(peers, local, device)
        runner.cache[f"local_world_size:{device.type}"] = local if agreed else None
        return "calibration"

    runner.run_now(measure)
    model = runner.cache[f"cost_model:{device.type}"]
    assert isinstance(model, selection.CostModel)
    return model


def _agree(call: _Call, trials: tuning.Trials) -> None:
    """Every rank adds up the trial times call by call (after the queued calls ran)."""
    runner, device = call.runner, call.device

    def agree(tag: int) -> str:
        seconds = torch.tensor(trials.local_seconds(), dtype=torch.float64, device=device)
        ring.all_reduce(_peers(runner, tag, device), seconds, Reduction(dist.ReduceOp.SUM, torch.float64))
        trials.agree(seconds.tolist())
        return "agreement"

    runner.run_now(agree)


def _auto(call: _Call) -> tuple[str, tuning.Trials | None]:
    """Auto's algorithm for this call, and its Trials when this call's time is to be recorded."""
    model = _calibrate(call)
    offered = _offered(call, for_auto=True)
    if not offered:
        assert call.refusal is not None
        raise call.refusal
    if len(offered) == 1:
        return offered[0], None
    layout = call.pods(agreed_only=True)
    pods = layout.shape if isinstance(layout, PodLayout) else None
    n, kind = call.runner.size, tuning.call_kind(call.op, call.nbytes, call.dtype_name, call.device.type)
    trials = call.runner.trials.get(kind)
    if trials is None:
        timed_calls = tuning.trials_from_env()
        if timed_calls == 0:  # the model alone; on NCCL it knows nothing of NCCL's own kernels
            if NATIVE in offered and call.backend == "nccl":
                return NATIVE, None
            return selection.choose(call.op, call.nbytes, n, call.dtype_name, model, offered, pods), None
        trials = tuning.plan(call.op, call.nbytes, n, call.dtype_name, model, timed_calls, offered, pods)
        call.runner.trials[kind] = trials
    if trials.ready_to_agree():
        _agree(call, trials)
    if trials.winner is not None:
        return trials.winner, None
    algorithm, timed = trials.take()
    return algorithm, trials if timed else None


def _decide(call: _Call, algorithm: str) -> tuple[str, tuning.Trials | None]:
    """The keyword, else DTJOB_COLLECTIVE_ALGO where it can run the call, else auto. Bad settings
    raise here, before any message is sent (a rank that raised would leave its peers waiting)."""
    selection.validate_keyword(call.op, algorithm)
    if algorithm != "auto":
        _refuse(call, algorithm)
        return algorithm, None
    forced = selection.env_override(call.op)
    tuning.trials_from_env()
    if forced is not None and forced in _offered(call, for_auto=False):
        return forced, None
    return _auto(call)


class _Timer:
    """A call's duration: perf_counter on CPU; CUDA events, read once they completed."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> tuning.Seconds:
        if not self._cuda:
            return time.perf_counter() - self._t0
        start, end = self._start, torch.cuda.Event(enable_timing=True)
        end.record()

        def seconds() -> float:
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        return seconds


def _execute(
    call: _Call,
    algorithm: str,
    async_op: bool,
    result: list[torch.Tensor],
    touched: list[torch.Tensor],
    run: Callable[[str, Peers], None],
    run_native: Callable[[bool], dist.Work | None],
) -> CollectiveWork | None:
    """Decide the call's algorithm (bad settings raise here, before any message is sent), then run
    it: native at once in this thread, dtjob's algorithms on the runner. `result` is what an async
    handle returns, `touched` every tensor the call reads or writes; `run(algorithm, peers)` runs
    one of dtjob's algorithms, `run_native(async_op)` the backend's own call."""
    algorithm, trials = _decide(call, algorithm)
    runner, device = call.runner, call.device
    runner.last_algorithm[call.op] = algorithm
    if algorithm == NATIVE:
        if trials is not None:  # a timed trial call runs on its own, as dtjob's trial calls do
            runner.drain()
            timer = _Timer(device)
            with abort.guard():
                run_native(False)
            trials.add(NATIVE, timer.stop())
            return CollectiveWork.completed(result, NATIVE) if async_op else None
        with abort.guard():  # a peer gone: GangAborted, and this rank's groups broken (#40)
            work = run_native(async_op)
        if not async_op:
            return None
        return (
            CollectiveWork.of_native(work, result)
            if work is not None
            else CollectiveWork.completed(result, NATIVE)
        )

    def job(tag: int) -> str:
        peers = _peers(runner, tag, device)
        with torch.no_grad():
            timer = _Timer(device) if trials is not None else None
            run(algorithm, peers)
            if trials is not None and timer is not None:
                trials.add(algorithm, timer.stop())
        return algorithm

    return runner.submit(job, async_op, result, device, touched)


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous 1-D view of `tensor`, or a copy (True) that must be written back."""
    if tensor.is_contiguous():
        return tensor.view(-1), False
    return tensor.contiguous().view(-1), True


def _nothing_to_send(tensors: list[torch.Tensor], async_op: bool) -> CollectiveWork | None:
    """One rank, or nothing to move: no message, a completed handle for an async call."""
    return CollectiveWork.completed(tensors, None) if async_op else None


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = dist.ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algorithm: str = "auto",
    local_world_size: int | None = None,
) -> CollectiveWork | None:
    """Reduce `tensor` across the group in place; every rank ends with the same bits.

    `local_world_size`: processes per worker pod, for algorithm="hier" (default: LOCAL_WORLD_SIZE).
    """
    name = "all_reduce"
    pg = _group(group, name)
    if pg is None:
        return None
    _check_tensor(name, "tensor", tensor)
    kind, reduction, refusal = _reduction(op, tensor.dtype, name)
    selection.validate_keyword("allreduce", algorithm)
    runner = runner_for(pg)
    if runner.size == 1 or tensor.numel() == 0:
        return _nothing_to_send([tensor], async_op)
    call = _Call.of("allreduce", name, runner, tensor, (kind, reduction, refusal))
    call.local_world_size = local_world_size

    def run(algo: str, peers: Peers) -> None:
        assert reduction is not None
        flat, copied = _flat(tensor)
        buf = reduction.view(flat)
        if algo == HIER:
            layout = call.pods(agreed_only=False)
            assert isinstance(layout, PodLayout)
            hierarchical.all_reduce(peers, buf, reduction, layout)
        else:
            _ALL_REDUCE[algo](peers, buf, reduction)
        if copied:
            tensor.copy_(flat.view_as(tensor))

    def run_native(async_call: bool) -> dist.Work | None:
        return native.all_reduce(tensor, op, kind, pg, async_call, call.backend)

    return _execute(call, algorithm, async_op, [tensor], [tensor], run, run_native)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: ReduceOpLike = dist.ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algorithm: str = "auto",
) -> CollectiveWork | None:
    """Reduce `input` (world_size x output.numel() elements) and keep this rank's slice in `output`."""
    name = "reduce_scatter_tensor"
    pg = _group(group, name)
    if pg is None:
        return None
    _check_tensor(name, "output", output)
    _check_tensor(name, "input", input)
    _check_pair(name, output, input)
    kind, reduction, refusal = _reduction(op, input.dtype, name)
    selection.validate_keyword("reduce_scatter", algorithm)
    runner = runner_for(pg)
    n, count = runner.size, output.numel()
    if input.numel() != n * count:
        raise InvalidArgument(
            f"{name}: input has {input.numel()} elements but must have world_size ({n}) x "
            f"output.numel() ({count}) = {n * count}"
        )
    if n == 1 or count == 0:
        output.copy_(input.view_as(output) if input.is_contiguous() else input.reshape(output.shape))
        return _nothing_to_send([output], async_op)
    call = _Call.of("reduce_scatter", name, runner, input, (kind, reduction, refusal))

    def run(algo: str, peers: Peers) -> None:
        assert reduction is not None
        src = reduction.view(input.reshape(-1))  # a view of a contiguous input, else a copy
        # The algorithms read src while they write out, so out must not share memory with it.
        shared = output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        separate = shared or not output.is_contiguous()
        flat_out = (
            torch.empty(count, dtype=output.dtype, device=output.device) if separate else output.view(-1)
        )
        out = reduction.view(flat_out)
        width = out.numel()
        _REDUCE_SCATTER[algo](peers, src, out, [i * width for i in range(n + 1)], reduction)
        if separate:
            output.copy_(flat_out.view_as(output))

    def run_native(async_call: bool) -> dist.Work | None:
        return native.reduce_scatter_tensor(output, input, op, kind, pg, async_call, call.backend)

    return _execute(call, algorithm, async_op, [output], [output, input], run, run_native)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algorithm: str = "auto",
) -> CollectiveWork | None:
    """Concatenate every rank's `input_tensor` (in group rank order) into `output_tensor`."""
    name = "all_gather_into_tensor"
    pg = _group(group, name)
    if pg is None:
        return None
    _check_tensor(name, "output_tensor", output_tensor)
    _check_tensor(name, "input_tensor", input_tensor)
    _check_pair(name, output_tensor, input_tensor)
    selection.validate_keyword("allgather", algorithm)
    runner = runner_for(pg)
    n, count = runner.size, input_tensor.numel()
    if output_tensor.numel() != n * count:
        raise InvalidArgument(
            f"{name}: output_tensor has {output_tensor.numel()} elements but must have world_size ({n}) "
            f"x input_tensor.numel() ({count}) = {n * count}"
        )
    if n == 1 or count == 0:
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return _nothing_to_send([output_tensor], async_op)
    call = _Call.of("allgather", name, runner, output_tensor)

    def run(algo: str, peers: Peers) -> None:
        flat, copied = _flat(output_tensor)
        buf = flat.view(torch.uint8)  # a copy moves bytes: any dtype
        width = call.nbytes // n
        bounds = [i * width for i in range(n + 1)]
        buf[bounds[peers.rank] : bounds[peers.rank + 1]].copy_(input_tensor.reshape(-1).view(torch.uint8))
        _ALL_GATHER[algo](peers, buf, bounds)
        if copied:
            output_tensor.copy_(flat.view_as(output_tensor))

    def run_native(async_call: bool) -> dist.Work | None:
        return native.all_gather_into_tensor(output_tensor, input_tensor, pg, async_call, call.backend)

    touched = [output_tensor, input_tensor]
    return _execute(call, algorithm, async_op, [output_tensor], touched, run, run_native)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    algorithm: str = "auto",
) -> CollectiveWork | None:
    """Copy `tensor` from global rank `src` (or group rank `group_src`) to every rank of the group."""
    name = "broadcast"
    pg = _group(group, name)
    if pg is None:
        return None
    _check_tensor(name, "tensor", tensor)
    if src is not None and group_src is not None:
        raise InvalidArgument(
            f"{name}: give src (a global rank) or group_src (a rank in the group), not both"
        )
    if src is None and group_src is None:
        raise InvalidArgument(f"{name}: give src (a global rank) or group_src (a rank in the group)")
    if group_src is None:
        assert src is not None
        try:
            root = dist.get_group_rank(pg, src)
        except (ValueError, RuntimeError) as error:
            raise InvalidArgument(f"{name}: src={src} is not a member of the group: {error}") from error
    else:
        root = group_src
    if not 0 <= root < pg.size():
        raise InvalidArgument(f"{name}: group_src={root} is outside the group (size {pg.size()})")
    selection.validate_keyword("broadcast", algorithm)
    runner = runner_for(pg)
    if runner.size == 1 or tensor.numel() == 0:
        return _nothing_to_send([tensor], async_op)
    call = _Call.of("broadcast", name, runner, tensor)

    def run(algo: str, peers: Peers) -> None:
        flat, copied = _flat(tensor)
        _BROADCAST[algo](peers, flat.view(torch.uint8), root)
        if copied:
            tensor.copy_(flat.view_as(tensor))

    def run_native(async_call: bool) -> dist.Work | None:
        return native.broadcast(tensor, pg, async_call, call.backend, runner.global_ranks[root])

    return _execute(call, algorithm, async_op, [tensor], [tensor], run, run_native)


def last_algorithm(op: str, group: ProcessGroup | None = None) -> str | None:
    """The algorithm the latest `op` call ("allreduce", "reduce_scatter", ...) on `group` ran
    (for an async call still queued: the one it will run)."""
    pg = _group(group, "last_algorithm")
    return None if pg is None else runner_for(pg).last_algorithm.get(op)


def calibrated_costs(
    group: ProcessGroup | None = None, device_type: str = "cpu"
) -> selection.CostModel | None:
    """The alpha-beta-gamma constants `auto` measured on `group` for `device_type` (None before
    its first auto call there)."""
    pg = _group(group, "calibrated_costs")
    cached = None if pg is None else runner_for(pg).cache.get(f"cost_model:{device_type}")
    return cached if isinstance(cached, selection.CostModel) else None


__all__ = [
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "calibrated_costs",
    "last_algorithm",
    "reduce_scatter_tensor",
]
