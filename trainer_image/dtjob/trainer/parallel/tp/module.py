"""`tensor_parallel(model, plan)`: split a model's layers across the ranks of a group, in place."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtjob.trainer.parallel import clip
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.common import NotSupported, Wrapper
from dtjob.trainer.parallel.shards import LocalShard
from dtjob.trainer.parallel.tp.layers import Sharder, ShardSpec, gather_full, parallelize
from dtjob.trainer.parallel.tp.ops import vocab_parallel_cross_entropy
from dtjob.trainer.parallel.tp.plans import auto_plan, check_heads, localize_heads


@dataclass
class TPState:
    """What a tensor-parallel model remembers (`model._dtjob_tp`): its group and, per local shard
    (by id), how it was cut from the full parameter."""

    comm: Comm
    plan: dict[str, str]
    specs: dict[int, ShardSpec]
    by_name: dict[str, ShardSpec]  # every state-dict key of a split parameter (tied ones twice)


_STATE = "_dtjob_tp"


def tp_state(model: nn.Module) -> TPState | None:
    """The TPState of a model `tensor_parallel` split, else None."""
    state = model.__dict__.get(_STATE)
    return state if isinstance(state, TPState) else None


# What each wrapper over a tensor_parallel model takes as group=, and where the mesh has it.
_GROUP_OF = {
    "data_parallel": "group=<data-parallel group> (dtjob.trainer.mesh(...).dp)",
    "fully_shard": "group=<data-parallel group> (dtjob.trainer.mesh(...).dp)",
    "pipeline": "group=<the ranks of this TP coordinate> (dtjob.trainer.mesh(...).dp_pp)",
}


def check_wrappable(model: nn.Module, wrapper: str, comm: Comm) -> None:
    """Refuse wrapping a tensor-parallel model where the result would be silently wrong: a wrapper
    other than data_parallel, fully_shard and pipeline, or one over a group that does not hold
    exactly one rank of each TP group it touches at the same TP coordinate (a broadcast of its rank
    0's parameters, or an average of gradients, would mix different shards). Collective over comm's
    group (one all-gather of two integers)."""
    state = tp_state(model)
    if state is None:
        return
    if wrapper not in _GROUP_OF:
        raise NotSupported(
            f"{wrapper}() of a tensor_parallel model is not supported; use data_parallel, fully_shard "
            "or pipeline over it with group= from dtjob.trainer.mesh()"
        )
    tp_ranks = {state.comm.global_rank(r) for r in range(state.comm.size)}
    ranks = {comm.global_rank(r) for r in range(comm.size)}
    if len(tp_ranks & ranks) > 1:
        raise ValueError(
            f"{wrapper}: its group holds ranks {sorted(tp_ranks & ranks)} of one tensor-parallel group; "
            f"pass {_GROUP_OF[wrapper]}: one rank of each TP group (ranks r, r+T, r+2T, ...)"
        )
    mine = torch.tensor([state.comm.rank, state.comm.size], dtype=torch.int64, device=comm.device)
    every = torch.empty(2 * comm.size, dtype=torch.int64, device=comm.device)
    comm.all_gather(every, mine)
    if len({tuple(pair) for pair in every.view(comm.size, 2).tolist()}) > 1:
        raise ValueError(
            f"{wrapper}: its group mixes ranks of different tensor-parallel coordinates (TP rank, size: "
            f"{every.view(comm.size, 2).tolist()}), whose shards differ; pass {_GROUP_OF[wrapper]}"
        )


def mark_bucket_grads(model: nn.Module, grads: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """data_parallel over a TP model: its persistent gradient views of the shards are pieces of a
    gradient spread over the TP group, for clip_grad_norm_ (the views replace autograd's .grad)."""
    state = tp_state(model)
    if state is None:
        return
    for param, grad in grads:
        if id(param) in state.specs:
            clip.mark(grad, state.comm)


def refuse_checkpoint_shards() -> list[LocalShard]:
    """What a tensor-parallel model answers to the checkpoint code (TrainState) where it is not
    under data_parallel, fully_shard or pipeline: which ranks replicate it is not known."""
    raise NotSupported(
        "checkpoints of a tensor_parallel model on its own (TrainState, ElasticSession) are not "
        "supported; wrap it with data_parallel or fully_shard over group=mesh(...).dp (one rank is "
        "fine) or pipeline over group=mesh(...).dp_pp, or save full_state_dict(model) on rank 0 and "
        "load it into the unwrapped model"
    )


def tp_size_of(model: nn.Module) -> int:
    """The tensor-parallel size T of `model` (a wrapper's inner model included): 1 unless split."""
    state = tp_state(getattr(model, "module", model))
    return 1 if state is None else state.comm.size


def check_checkpoint_tp_size(saved: int, model: nn.Module) -> None:
    """A checkpoint's split parameters are named per TP rank of its T (tp_checkpoint_name): at
    another T they are other tensors. Refuse that, naming the conversion."""
    mine = tp_size_of(model)
    if saved != mine:
        raise ValueError(
            f"checkpoint: written at tensor-parallel size {saved}, this model's is {mine}; resume with "
            f"the same size (the data-parallel size may change), or convert it through full_state_dict: "
            f"load it at size {saved}, save full_state_dict(model), load that into the unwrapped model, "
            "then tensor_parallel() it"
        )


def tp_checkpoint_name(name: str, rank: int, size: int) -> str:
    """The checkpoint name of TP rank `rank`'s shard of parameter `name`: a global tensor of its own,
    so a checkpoint resumes at any data-parallel size with the same TP size; another TP size finds
    no such tensor (change it through full_state_dict)."""
    return f"{name}#tp{rank}of{size}"


def checkpoint_shards(model: nn.Module, shards: list[LocalShard]) -> list[LocalShard]:
    """A data_parallel / fully_shard / pipeline wrapper's local shards of a tensor_parallel model (each its
    data-parallel piece of this TP rank's tensor) as checkpoint entries: a split parameter under
    its TP-qualified name (tp_checkpoint_name), the replicated ones (and the buffers) written by TP
    rank 0 only, so every element is written once."""
    state = tp_state(model)
    if state is None:
        return shards
    rank, size = state.comm.rank, state.comm.size
    out = []
    for shard in shards:
        if shard.name in state.by_name:
            out.append(dataclasses.replace(shard, name=tp_checkpoint_name(shard.name, rank, size)))
        else:
            out.append(shard if rank == 0 else dataclasses.replace(shard, write=(0, 0)))
    return out


def _resolve(model: nn.Module, plan: dict[str, str]) -> dict[str, tuple[nn.Module, str]]:
    """Module name -> (module, kind) for every plan pattern; every pattern must match."""
    named = dict(model.named_modules())
    out: dict[str, tuple[nn.Module, str]] = {}
    for pattern, kind in plan.items():
        hits = [name for name in named if name and fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise ValueError(
                f"tensor_parallel: plan pattern {pattern!r} matches no module of {type(model).__name__}"
            )
        for name in hits:
            if name in out and out[name][1] != kind:
                raise ValueError(
                    f"tensor_parallel: {name!r} is matched as both {out[name][1]!r} and {kind!r}"
                )
            out[name] = (named[name], kind)
    return out


def _refuse_dropout(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            raise ValueError(
                f"tensor_parallel: {name} is a dropout with p={m.p}: dropout is not supported (its random "
                "masks are not coordinated across the TP ranks); set p=0"
            )


def _refuse_half_tied(model: nn.Module, targets: dict[str, tuple[nn.Module, str]], sharder: Sharder) -> None:
    """A parameter split in one module but tied to a module outside the plan would silently untie."""
    split = sharder.split_originals()
    for name, m in model.named_modules():
        if name in targets:
            continue
        for attr, p in m.named_parameters(recurse=False):
            if id(p) in split:
                raise ValueError(
                    f"tensor_parallel: {name}.{attr} is tied to {split[id(p)]}, which the plan splits; "
                    f"add {name!r} to the plan with the same kind"
                )


def _is_causal_lm(model: nn.Module) -> bool:
    name = type(model).__name__
    return hasattr(model, "config") and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))


def _refuse_generate(*args: Any, **kwargs: Any) -> Any:
    raise NotSupported(
        "generate() of a tensor_parallel model with a vocab-split head is not supported (its logits are "
        "this rank's vocabulary slice); generate with the unwrapped model loaded from full_state_dict(model)"
    )


def _intercept_labels(model: nn.Module, comm: Comm) -> None:
    """A Hugging Face causal LM with a vocab-split head would compute its loss from this rank's
    slice of the logits: take `labels=` and compute the loss with vocab_parallel_cross_entropy."""
    original = model.forward
    causal = _is_causal_lm(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        labels = kwargs.pop("labels", None)
        if labels is None:
            return original(*args, **kwargs)
        if not causal:
            raise NotSupported(
                f"tensor_parallel: {type(model).__name__}(labels=...) with a vocab-split head; compute the "
                "loss with dtjob.trainer.vocab_parallel_cross_entropy(logits_shard, targets, group)"
            )
        out = original(*args, **kwargs)
        logits = out.logits[..., :-1, :]
        out.loss = vocab_parallel_cross_entropy(logits, labels[..., 1:].to(logits.device), comm)
        return out

    object.__setattr__(model, "forward", forward)
    if callable(getattr(model, "generate", None)):  # it would pick tokens from this rank's slice
        object.__setattr__(model, "generate", _refuse_generate)


def tensor_parallel(
    model: nn.Module,
    plan: dict[str, str] | str,
    *,
    group: dist.ProcessGroup | None = None,
    collective: str = "auto",
) -> nn.Module:
    """Split `model`'s layers over the ranks of `group` (default: the whole world), in place, and
    return it (as torch's `parallelize_module` does).

    plan: {fnmatch pattern of module names: kind} (`*` matches across dots too), kinds "colwise",
    "colwise_qkv", "rowwise", "vocab" (see tp/layers.py), or "auto" for Hugging Face GPT-2 and
    Llama. Each split parameter keeps its name and becomes this rank's shard, with its local shape
    (rank r holds the r-th of T equal slices along the split dimension); the optimizer is built on
    the returned model. Every rank runs the same batch; the loss is replicated. A "vocab" LM head
    outputs this rank's slice of the logits: use `vocab_parallel_cross_entropy`, or pass
    `labels=` to a Hugging Face causal LM (its loss is then computed that way).
    Attention: split q/k/v colwise and the output projection rowwise, so each rank runs its
    heads; the attention must reshape with -1 heads (Llama's does) or have its head count made
    local (GPT-2's is, here). Refused: a pattern matching nothing, a size not divisible by the TP
    size, dropout with p > 0, an already wrapped model.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "tensor_parallel() needs torch.distributed.init_process_group() to be called first"
        )
    if isinstance(model, Wrapper) or tp_state(model) is not None:
        raise ValueError(
            f"tensor_parallel: the model is already wrapped ({type(model).__name__}); apply tensor_parallel "
            "first, then data_parallel(model, group=<data-parallel group>)"
        )
    comm = Comm(collective, group)
    plan = auto_plan(model) if plan == "auto" else plan
    if not isinstance(plan, dict):
        raise ValueError(f"tensor_parallel: plan must be a dict of pattern -> kind or 'auto', got {plan!r}")
    targets = _resolve(model, plan)
    _refuse_dropout(model)
    check_heads(model, comm.size)
    sharder = Sharder(comm)
    with torch.no_grad():
        for name, (module, kind) in targets.items():
            parallelize(module, kind, name, sharder)
    _refuse_half_tied(model, targets, sharder)
    localize_heads(model, comm.size)
    if any(kind == "vocab" and not isinstance(m, nn.Embedding) for m, kind in targets.values()):
        _intercept_labels(model, comm)
    by_name = {
        key: sharder.specs[id(t)]
        for key, t in model.state_dict(keep_vars=True).items()
        if id(t) in sharder.specs
    }
    object.__setattr__(model, _STATE, TPState(comm, dict(plan), sharder.specs, by_name))

    def mark(piece: torch.Tensor) -> None:
        assert piece.grad is not None
        if not clip.is_marked(piece.grad):  # a pipeline's gradient views carry their own marks
            clip.mark(piece.grad, comm)

    for piece in sharder.pieces():
        clip.mark_split(piece, comm)  # a wrapper's gradient of it is also spread over the TP group
        # clip_grad_norm_ then sums the shards' norms over the TP group (parallel/clip.py).
        piece.register_post_accumulate_grad_hook(mark)
    clip.install()
    for method in ("local_shards", "local_buffers"):  # what train_state.local_shards_of asks
        object.__setattr__(model, method, refuse_checkpoint_shards)
    return model


def tp_full_state_dict(model: nn.Module, state: TPState, rank0_only: bool) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict: every split parameter gathered over the TP group (all ranks
    of it must call this), on global rank 0 (everywhere with rank0_only=False)."""
    local = {key: t.detach() for key, t in model.state_dict(keep_vars=True).items()}
    out = gather_split(local, state)
    if rank0_only and dist.get_rank() != 0:
        return {}
    return out


def gather_split(local: dict[str, torch.Tensor], state: TPState) -> dict[str, torch.Tensor]:
    """`local` (a state dict of this TP rank's shards, by the model's keys, as a wrapper over the
    TP model gathered it) with every split parameter joined over the TP group, on the CPU. Every
    rank of the TP group calls it with the same keys in the same order (a collective per key)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in local.items():
        spec = state.by_name.get(key)
        full = gather_full(tensor.to(state.comm.device), spec, state.comm) if spec is not None else tensor
        out[key] = full.detach().cpu().clone()
    return out
