"""3-D parallelism cases (tests/trainer/test_parallel_3d.py) run in one real gloo world.

A "train" case: model ("hf-gpt2" | "hf-llama" | "encoder": the T5-like encoder below, with its own
plan), dp, tp, pp (the mesh), zero (fully_shard's stage over the DP group when pp == 1), clip
(max gradient norm, or None), steps; wrapper "ddp" for data_parallel over mesh.dp; save_to (a
directory: a TrainState checkpoint after the last step), load_from and start_step (resume from
one). Every rank builds the mesh, splits the model over mesh.tp and
wraps it (fully_shard over mesh.dp, or pipeline over mesh.dp_pp), trains with AdamW and returns its
losses and full_state_dict. `reference(case)` trains the unwrapped model in one process on the
same global batches. "mesh" and "errors" cases return the mesh's groups and the refusals' messages.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.trainer import _parallel_harness as harness
from tests.trainer import _tp_cases as tp_cases

ENC_VOCAB, ENC_SEQ = 80, 12
ENCODER_PLAN = {
    "embed": "vocab",
    "layers.*.attn.[qkv]": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.ffn.wi_[01]": "colwise",
    "layers.*.ffn.wo": "rowwise",
    "head": "vocab",
}


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class EncoderAttention(nn.Module):
    """Bidirectional attention without biases (T5's); heads from the local width (-1)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class GatedFFN(nn.Module):
    """T5 v1.1's gated-GELU feed-forward: wo(gelu(wi_0 x) * wi_1 x)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(width, hidden, bias=False)
        self.wi_1 = nn.Linear(width, hidden, bias=False)
        self.wo = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi_0(x)) * self.wi_1(x))


class EncoderLayer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.attn = EncoderAttention(width, heads)
        self.ffn = GatedFFN(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyEncoder(nn.Module):
    """A user's own T5-like encoder with a token-classification head (no other test uses it)."""

    def __init__(self, width: int = 32, heads: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(ENC_VOCAB, width)
        self.layers = nn.ModuleList(EncoderLayer(width, heads) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, ENC_VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def build(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return TinyEncoder() if case["model"] == "encoder" else harness.hf_model(case["model"])


def batch(case: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the global batch of `step`; an HF model's targets are its inputs."""
    if case["model"] != "encoder":
        tokens = tp_cases.batch(case, step)
        return tokens, tokens
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, ENC_VOCAB, (4, ENC_SEQ), generator=g)
    return ids, (ids * 7 + ids.roll(1, dims=1)) % ENC_VOCAB  # a token-level function of its context


def encoder_loss(logits: torch.Tensor, targets: torch.Tensor, tp_group: Any) -> torch.Tensor:
    from dtjob.trainer import vocab_parallel_cross_entropy

    if tp_group is None:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    return vocab_parallel_cross_entropy(logits, targets, tp_group)


def loss_of(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, case: dict[str, Any], tp: Any
) -> torch.Tensor:
    if case["model"] != "encoder":
        loss: torch.Tensor = model(input_ids=inputs, labels=targets).loss
        return loss
    return encoder_loss(model(inputs), targets, tp)


def reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the unwrapped model, the whole batch: losses per step and the final state dict."""
    model = build(case)
    opt = tp_cases.optimizer(model)
    losses = []
    for step in range(case.get("steps", 10)):
        loss = loss_of(model, *batch(case, step), case, None)
        loss.backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _wrap(case: dict[str, Any], m: Any) -> nn.Module:
    from dtjob.trainer import data_parallel, fully_shard, pipeline, tensor_parallel

    plan = ENCODER_PLAN if case["model"] == "encoder" else "auto"
    model = tensor_parallel(build(case), plan, group=m.tp)
    if case["pp"] > 1:
        loss_fn = None
        if case["model"] == "encoder":

            def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                return encoder_loss(logits, targets, m.tp)

        return pipeline(model, stages=case["pp"], microbatches=2, loss_fn=loss_fn, group=m.dp_pp)
    if case.get("wrapper") == "ddp":
        return data_parallel(model, group=m.dp)
    return fully_shard(model, zero_stage=case["zero"], group=m.dp)


def _train(case: dict[str, Any]) -> dict[str, Any]:
    from dtjob.trainer import full_state_dict, mesh
    from dtjob.trainer.train_state import TrainState

    m = mesh(dp=case["dp"], tp=case["tp"], pp=case["pp"])
    wrapped: Any = _wrap(case, m)
    opt = tp_cases.optimizer(wrapped)
    checkpoint = TrainState(wrapped, opt) if "save_to" in case or "load_from" in case else None
    if checkpoint is not None and "load_from" in case:
        dist.barrier()  # a checkpoint saved by an earlier case of this world: every rank's file
        harness._load_checkpoint(checkpoint, case["load_from"])
    losses: list[float] = []
    norms: list[float] = []
    for step in range(case.get("start_step", 0), case.get("steps", 10)):
        inputs, targets = (t.chunk(m.dp_size)[m.dp_rank] for t in batch(case, step))
        if case["pp"] > 1:
            hf = case["model"] != "encoder"
            loss = wrapped.step(
                {"input_ids": inputs, "labels": targets} if hf else inputs, None if hf else targets
            )
        else:
            loss = loss_of(wrapped, inputs, targets, case, m.tp)
            loss.backward()
            # Each DP rank's loss is of its part of the batch: the batch's is their mean.
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=m.dp)
            loss = float(loss) / m.dp_size
        if case.get("clip"):  # the user's torch call: every rank's pieces counted once
            norms.append(float(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), case["clip"])))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    if checkpoint is not None and "save_to" in case:  # as the harness's cases save theirs
        saved = {"shards": harness._shards_to_plain(checkpoint), "extra": checkpoint.extra_state()}
        os.makedirs(case["save_to"], exist_ok=True)
        torch.save(saved, os.path.join(case["save_to"], f"rank{dist.get_rank()}.pt"))
    return {"losses": losses, "norms": norms, "state": full_state_dict(wrapped)}


def _mesh(case: dict[str, Any]) -> dict[str, Any]:
    """The ranks of this rank's groups and its coordinates, for each mesh shape of world 4."""
    from dtjob.trainer import mesh

    out: dict[str, Any] = {}
    for dp, tp, pp in ((1, 2, 2), (2, 2, 1), (2, 1, 2), (1, 4, 1)):
        m = mesh(dp=dp, tp=tp, pp=pp)
        out[f"{dp}x{tp}x{pp}"] = {
            "coords": (m.dp_rank, m.pp_rank, m.tp_rank),
            **{g: dist.get_process_group_ranks(getattr(m, g)) for g in ("tp", "pp", "dp", "dp_pp")},
        }
    return out


def _message(call: Any) -> str:
    try:
        call()
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return "accepted"


def _errors(case: dict[str, Any]) -> dict[str, Any]:
    """The message of each refused use of the mesh and of wrappers over a TP model."""
    from dtjob.trainer import fully_shard, mesh, pipeline, tensor_parallel
    from dtjob.trainer.parallel.comm import new_group
    from dtjob.trainer.train_state import local_shards_of

    def with_pod(local: str) -> str:
        os.environ["LOCAL_WORLD_SIZE"] = local
        try:
            return _message(lambda: mesh(dp=1, tp=4))
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]

    m = mesh(dp=2, tp=2)
    rank = dist.get_rank()
    # Ranks {0, 3} and {1, 2}: one of each TP group, but at different TP coordinates.
    mixed = [new_group(r) for r in ([0, 3], [1, 2])]
    mixed_group = mixed[0] if rank in (0, 3) else mixed[1]

    def split() -> nn.Module:
        return tensor_parallel(TinyEncoder(), ENCODER_PLAN, group=m.tp)

    return {
        "sizes": _message(lambda: mesh(dp=2, tp=2, pp=2)),
        "not_a_size": _message(lambda: mesh(dp=0, tp=4)),
        "tp_across_pods": with_pod("2"),
        "tp_in_pod": with_pod("4"),
        "fully_shard_world": _message(lambda: fully_shard(split(), zero_stage=2)),
        "fully_shard_mixed": _message(lambda: fully_shard(split(), zero_stage=2, group=mixed_group)),
        "pipeline_world": _message(lambda: pipeline(split(), stages=2)),
        "checkpoint_fsdp": _message(lambda: local_shards_of(fully_shard(split(), group=m.dp))),
        "checkpoint_pipeline": _message(
            lambda: local_shards_of(pipeline(split(), stages=2, group=_dp_pp_of_tp2()))
        ),
        "checkpoint_bare": _message(lambda: local_shards_of(split())),
        "checkpoint_other_tp": _message(lambda: _load_at_tp(4, fully_shard(split(), group=m.dp))),
    }


def _load_at_tp(saved_tp: int, wrapped: nn.Module) -> None:
    """TrainState.load of a checkpoint whose manifest says it was written at TP size saved_tp."""
    from dtjob.trainer.train_state import TrainState

    def fetch(key: str, start: int, length: int) -> torch.Tensor:
        raise AssertionError(f"fetched {key} from a checkpoint of another TP size")

    TrainState(wrapped).load(fetch, {"tensor_parallel": saved_tp}, {})


def _dp_pp_of_tp2() -> Any:
    from dtjob.trainer import mesh

    return mesh(dp=1, tp=2, pp=2).dp_pp


_KINDS = {"train": _train, "mesh": _mesh, "errors": _errors}


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    return _KINDS[case["kind"]](case)


def run_3d_world(world_size: int, cases: list[dict[str, Any]], timeout: float = 900) -> list[dict[str, Any]]:
    """Run `cases` in one gloo group of `world_size` processes; each rank's results by case name."""
    return harness.run_world(world_size, cases, timeout, run_case=_run_case)
