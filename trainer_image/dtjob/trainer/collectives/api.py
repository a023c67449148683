"""The four collectives, with torch.distributed's signatures plus `algorithm=`.

Each call validates its arguments in the caller (clear errors, before any message is sent), then
hands a job to the group's runner (work.py), which runs it in call order, inline or on the group's
worker thread for `async_op=True`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dtjob.trainer.collectives import broadcast as broadcast_algos
from dtjob.trainer.collectives import direct, halving_doubling, ring, selection, tuning
from dtjob.trainer.collectives.calibration import cost_model
from dtjob.trainer.collectives.comm import Comm
from dtjob.trainer.collectives.reduce_ops import SUPPORTED_DTYPES, ReduceOpLike, Reduction
from dtjob.trainer.collectives.work import CollectiveWork, GroupRunner, completed_work, runner_for

ProcessGroup = dist.ProcessGroup

# Each op's algorithms by name (the names selection.ALGORITHMS offers).
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
        raise TypeError(f"{name}: group must be a ProcessGroup from new_group() or None, got {group!r}")
    return group


def _check_tensor(name: str, arg: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise TypeError(
            f"{name}: {arg} has dtype {tensor.dtype}, which is not supported; use one of {supported}"
        )
    return tensor


def _check_pair(name: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"{name}: output dtype {output.dtype} differs from input dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{name}: output is on {output.device} but input is on {input.device}")


def _algorithm(op: str, algorithm: str) -> str:
    """The keyword, or the environment's override of "auto"; bad settings raise here, before any
    message is sent (in the job, a rank that raised would leave its peers waiting)."""
    selection.validate_keyword(op, algorithm)
    if algorithm == "auto":
        choice = selection.env_override(op) or "auto"
        if choice == "auto":
            tuning.trials_from_env()
        return choice
    return algorithm


def _auto(op: str, runner: GroupRunner, comm: Comm, vector: torch.Tensor) -> tuple[str, tuning.Trials | None]:
    """Auto's algorithm for this call, and the kind's Trials while they still time candidates.

    The cost model names the candidates; during a kind's trials they take turns, the ranks agree
    on the finalists and then on the fastest, and keep it (tuning.py). With trials off the model
    alone decides.
    """
    nbytes = vector.numel() * vector.element_size()
    dtype_name = str(vector.dtype).removeprefix("torch.")
    kind = tuning.call_kind(op, nbytes, dtype_name)
    trials = runner.trials.get(kind)
    if trials is None:  # a new kind (or trials off): ask the model
        model = cost_model(runner, comm)
        timed_calls = tuning.trials_from_env()
        if timed_calls == 0:
            return selection.choose(op, nbytes, comm.size, dtype_name, model), None
        trials = runner.trials[kind] = tuning.plan(op, nbytes, comm.size, dtype_name, model, timed_calls)
    if trials.ready_to_agree():  # the same call on every rank: all counted the same trials
        seconds = torch.tensor(trials.local_seconds(), dtype=torch.float64)
        ring.all_reduce(comm, seconds, Reduction(dist.ReduceOp.SUM, torch.float64))
        trials.agree(seconds.tolist())
    if trials.winner is not None:
        return trials.winner, None
    return trials.next_candidate(), trials


def _run(
    op: str, choice: str, runner: GroupRunner, comm: Comm, vector: torch.Tensor, run: Callable[[str], None]
) -> str:
    """Run one call of `op` on the flat `vector` with `choice` ("auto" resolved); returns what ran."""
    algorithm, trials = (choice, None) if choice != "auto" else _auto(op, runner, comm, vector)
    runner.last_algorithm[op] = algorithm
    start = time.perf_counter()
    run(algorithm)
    if trials is not None:
        trials.record(algorithm, time.perf_counter() - start)
    return algorithm


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A contiguous 1-D view of `tensor`, or a copy (True) that must be written back."""
    if tensor.is_contiguous():
        return tensor.view(-1), False
    return tensor.contiguous().view(-1), True


def _submit(
    runner: GroupRunner, job: Callable[[Comm], str], async_op: bool, tensors: list[torch.Tensor]
) -> CollectiveWork | None:
    group = runner.group
    pool = runner.scratch_pool
    return runner.submit(lambda tag: job(Comm(group, tag, scratch_pool=pool)), async_op, tensors)


def _submit_in_place(
    op: str,
    choice: str,
    runner: GroupRunner,
    tensor: torch.Tensor,
    async_op: bool,
    algorithm: Callable[[str, Comm, torch.Tensor], None],
) -> CollectiveWork | None:
    """Submit `algorithm(name, comm, flat)` on a flat view of `tensor` (all_reduce, broadcast and
    all_gather work in place); a non-contiguous tensor is worked on in a copy, written back after."""

    def job(comm: Comm) -> str:
        flat, copied = _flat(tensor)
        ran = _run(op, choice, runner, comm, flat, lambda name: algorithm(name, comm, flat))
        if copied:
            tensor.copy_(flat.view_as(tensor))
        return ran

    return _submit(runner, job, async_op, [tensor])


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpLike = dist.ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    algorithm: str = "auto",
) -> CollectiveWork | None:
    """Reduce `tensor` across the group in place; every rank ends with the same bits."""
    pg = _group(group, "all_reduce")
    if pg is None:
        return None
    _check_tensor("all_reduce", "tensor", tensor)
    reduction = Reduction(op, tensor.dtype)
    choice = _algorithm("allreduce", algorithm)
    runner = runner_for(pg)
    if runner.size == 1 or tensor.numel() == 0:
        return completed_work([tensor]) if async_op else None

    def run(name: str, comm: Comm, flat: torch.Tensor) -> None:
        _ALL_REDUCE[name](comm, flat, reduction)

    return _submit_in_place("allreduce", choice, runner, tensor, async_op, run)


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
    reduction = Reduction(op, input.dtype)
    choice = _algorithm("reduce_scatter", algorithm)
    runner = runner_for(pg)
    n, count = runner.size, output.numel()
    if input.numel() != n * count:
        raise ValueError(
            f"{name}: input has {input.numel()} elements but must have world_size ({n}) x "
            f"output.numel() ({count}) = {n * count}"
        )
    if n == 1 or count == 0:
        output.copy_(input.view_as(output) if input.is_contiguous() else input.reshape(output.shape))
        return completed_work([output]) if async_op else None

    def job(comm: Comm) -> str:
        src = input.reshape(-1)  # a view of a contiguous input, else a copy
        # The algorithms read src while they write out, so out must not share memory with it.
        shared = output.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
        separate = shared or not output.is_contiguous()
        out = torch.empty(count, dtype=src.dtype, device=src.device) if separate else output.view(-1)
        bounds = [i * count for i in range(n + 1)]
        algo = _run(
            "reduce_scatter",
            choice,
            runner,
            comm,
            src,
            lambda a: _REDUCE_SCATTER[a](comm, src, out, bounds, reduction),
        )
        if separate:
            output.copy_(out.view_as(output))
        return algo

    return _submit(runner, job, async_op, [output])


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
    choice = _algorithm("allgather", algorithm)
    runner = runner_for(pg)
    n, count = runner.size, input_tensor.numel()
    if output_tensor.numel() != n * count:
        raise ValueError(
            f"{name}: output_tensor has {output_tensor.numel()} elements but must have world_size ({n}) "
            f"x input_tensor.numel() ({count}) = {n * count}"
        )
    if n == 1 or count == 0:
        output_tensor.copy_(input_tensor.reshape(output_tensor.shape))
        return completed_work([output_tensor]) if async_op else None

    bounds = [i * count for i in range(n + 1)]

    def run(name: str, comm: Comm, flat: torch.Tensor) -> None:
        flat[bounds[comm.rank] : bounds[comm.rank + 1]].copy_(input_tensor.reshape(-1))
        _ALL_GATHER[name](comm, flat, bounds)

    return _submit_in_place("allgather", choice, runner, output_tensor, async_op, run)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    *,
    group_src: int | None = None,
    algorithm: str = "auto",
) -> CollectiveWork | None:
    """Copy `tensor` from global rank `src` (or group rank `group_src`) to every rank of the group."""
    pg = _group(group, "broadcast")
    if pg is None:
        return None
    _check_tensor("broadcast", "tensor", tensor)
    if (src is None) == (group_src is None):
        raise ValueError("broadcast: give exactly one of src (global rank) or group_src (rank in group)")
    if group_src is None:
        assert src is not None
        try:
            root = dist.get_group_rank(pg, src)
        except (ValueError, RuntimeError) as error:
            raise ValueError(f"broadcast: src={src} is not a member of the group: {error}") from error
    else:
        root = group_src
    if not 0 <= root < pg.size():
        raise ValueError(f"broadcast: group_src={root} is outside the group (size {pg.size()})")
    choice = _algorithm("broadcast", algorithm)
    runner = runner_for(pg)
    if runner.size == 1 or tensor.numel() == 0:
        return completed_work([tensor]) if async_op else None

    def run(name: str, comm: Comm, flat: torch.Tensor) -> None:
        _BROADCAST[name](comm, flat, root)

    return _submit_in_place("broadcast", choice, runner, tensor, async_op, run)


def last_algorithm(op: str, group: ProcessGroup | None = None) -> str | None:
    """The algorithm the latest `op` call ("allreduce", "reduce_scatter", ...) on `group` ran."""
    pg = _group(group, "last_algorithm")
    return None if pg is None else runner_for(pg).last_algorithm.get(op)


def calibrated_costs(group: ProcessGroup | None = None) -> selection.CostModel | None:
    """The alpha-beta-gamma constants `auto` measured on `group` (None before its first auto call)."""
    pg = _group(group, "calibrated_costs")
    cached = None if pg is None else runner_for(pg).cache.get("cost_model")
    return cached if isinstance(cached, selection.CostModel) else None


__all__ = [
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "calibrated_costs",
    "last_algorithm",
    "reduce_scatter_tensor",
]
