"""Tensor-parallel cases run in real multi-process gloo groups (tests/trainer/test_tensor_parallel.py).

`run_tp_world(world_size, cases)` spawns one group for many cases (spawning costs seconds here),
as _parallel_harness.World does. A case: name, kind ("train" | "ce" | "errors"), model
("hf-gpt2" | "hf-llama" | "tiny-lm": a small transformer of this file, with its own plan), tp
(the TP size; the rest of the world is data parallel over consecutive TP groups), steps.
`reference(case)` trains the unwrapped model in this process on the same global batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.trainer import _parallel_harness as harness
from tests.trainer._parallel_harness import HF_SEQ, HF_VOCAB, hf_model

TINY_VOCAB, TINY_SEQ = 64, 8
TINY_PLAN = {
    "emb": "vocab",
    "blocks.*.attn.[qkv]": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
    "head": "vocab",
}


class TinyAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, -1))


class TinyBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = TinyAttention(width, heads)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """A user's own small transformer (no test of the other wrappers uses it): untied head."""

    def __init__(self, width: int = 24, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(TINY_VOCAB, width)
        self.pos = nn.Parameter(torch.randn(TINY_SEQ, width) * 0.1)
        self.blocks = nn.ModuleList(TinyBlock(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, TINY_VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def build(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    return TinyLM() if case["model"] == "tiny-lm" else hf_model(case["model"])


def batch(case: dict[str, Any], step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    vocab, seq = (TINY_VOCAB, TINY_SEQ + 1) if case["model"] == "tiny-lm" else (HF_VOCAB, HF_SEQ)
    return torch.randint(0, vocab, (case.get("batch", 4), seq), generator=g)


def loss_of(
    model: nn.Module, tokens: torch.Tensor, case: dict[str, Any], tp_group: Any = None
) -> torch.Tensor:
    """The user's loss line: HF models shift their labels; the tiny LM's loss is written by hand,
    the vocab-parallel one under TP."""
    if case["model"] != "tiny-lm":
        loss: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
        return loss
    logits = model(tokens[:, :-1])
    if tp_group is False:
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    from dtjob.trainer import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, tokens[:, 1:], tp_group)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # eps=1e-5 as in _parallel_harness.make_optimizer: the attention's key bias has an
    # analytically zero gradient, and with eps=1e-8 Adam turns its rounding noise (which depends
    # on summation order, so on the split) into full-size steps (3.9e-4 relative on GPT-2's c_attn
    # bias after 10 steps, while every loss agreed within 1e-5).
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)


def reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the unwrapped model, the whole batch: losses per step and the final state dict."""
    model = build(case)
    opt = optimizer(model)
    losses = []
    for step in range(case.get("steps", 10)):
        loss = loss_of(model, batch(case, step), case, tp_group=False)
        loss.backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _groups(tp: int) -> tuple[Any, Any, int, int]:
    """TP groups of consecutive ranks, DP groups across them (every rank creates every group)."""
    from dtjob.trainer.parallel.comm import new_group

    world, rank = dist.get_world_size(), dist.get_rank()
    tp_group = dp_group = None
    for start in range(0, world, tp):
        g = new_group(list(range(start, start + tp)))
        tp_group = g if g is not None else tp_group
    for offset in range(tp):
        g = new_group(list(range(offset, world, tp)))
        dp_group = g if g is not None else dp_group
    return tp_group, dp_group, rank // tp, world // tp


def _train(case: dict[str, Any]) -> dict[str, Any]:
    from dtjob.trainer import data_parallel, full_state_dict, tensor_parallel

    tp_group, dp_group, dp_rank, dp_size = _groups(case["tp"])
    plan = TINY_PLAN if case["model"] == "tiny-lm" else "auto"
    model: nn.Module = tensor_parallel(build(case), plan, group=tp_group)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if dp_size > 1:
        model = data_parallel(model, group=dp_group)
    opt = optimizer(model)
    losses: list[float] = []
    norms: list[float] = []
    for step in range(case.get("steps", 10)):
        tokens = batch(case, step).chunk(dp_size)[dp_rank]
        loss = loss_of(model, tokens, case, tp_group)
        loss.backward()
        if case.get("clip"):  # the user's torch call: it counts every TP rank's shards
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": full_state_dict(model), "local_shapes": shapes, "norms": norms}


def _ce(case: dict[str, Any]) -> dict[str, Any]:
    """The vocab-parallel loss and its logits gradient on a fixed full-logits tensor (ignored
    targets included), from this rank's vocabulary slice."""
    from dtjob.trainer import vocab_parallel_cross_entropy

    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 10, generator=g) * 4
    targets = torch.randint(0, 10, (3, 5), generator=g)
    targets[0, 1] = targets[2, 4] = -100
    rank, size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for reduction in ("mean", "sum", "none"):
        shard = logits.chunk(size, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, targets, None, reduction=reduction)
        weights = torch.arange(loss.numel(), dtype=loss.dtype).view(loss.shape) + 1
        (loss * weights).sum().backward()
        out[reduction] = (loss.detach(), shard.grad)
    return out


def _errors(case: dict[str, Any]) -> dict[str, Any]:
    """The message of each refused use."""
    from dtjob.trainer import tensor_parallel

    def message(make: Any, plan: Any) -> str:
        try:
            tensor_parallel(make(), plan)
        except (ValueError, NotImplementedError) as e:
            return str(e)
        return "accepted"

    def dropout_lm() -> nn.Module:
        model = TinyLM()
        model.blocks[0].add_module("drop", nn.Dropout(0.1))
        return model

    def tied_lm() -> nn.Module:
        model = TinyLM(width=TINY_VOCAB)
        model.head.weight = model.emb.weight
        return model

    def generate_message() -> str:
        model: Any = tensor_parallel(hf_model("hf-gpt2"), "auto")
        try:
            model.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2)
        except NotImplementedError as e:
            return str(e)
        return "accepted"

    def wrapped(wrap: Any) -> str:
        try:
            wrap(tensor_parallel(TinyLM(), TINY_PLAN))
        except (ValueError, NotImplementedError) as e:
            return str(e)
        return "accepted"

    from dtjob.trainer import data_parallel, fully_shard
    from dtjob.trainer.train_state import local_shards_of

    plan = dict(TINY_PLAN)
    return {
        "dp_over_tp_group": wrapped(data_parallel),
        "fully_shard": wrapped(fully_shard),
        "checkpoint": wrapped(local_shards_of),
        "generate": generate_message(),
        "no_match": message(TinyLM, {**plan, "blocks.*.mlp.up": "colwise"}),
        "indivisible": message(lambda: TinyLM(width=21, heads=3), plan),
        "dropout": message(dropout_lm, plan),
        "auto_unknown": message(TinyLM, "auto"),
        "bad_kind": message(TinyLM, {**plan, "head": "columnwise"}),
        "embedding_colwise": message(TinyLM, {**plan, "emb": "colwise"}),
        "half_tied": message(tied_lm, {k: v for k, v in plan.items() if k != "emb"}),
        "not_linear": message(TinyLM, {**plan, "blocks.*.ln1": "colwise"}),
    }


_KINDS = {"train": _train, "ce": _ce, "errors": _errors}


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    return _KINDS[case["kind"]](case)


def run_tp_world(world_size: int, cases: list[dict[str, Any]], timeout: float = 600) -> list[dict[str, Any]]:
    """Run `cases` in one gloo group of `world_size` processes; each rank's results by case name."""
    return harness.run_world(world_size, cases, timeout, run_case=_run_case)
