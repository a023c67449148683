"""A nanoGPT-like model and nanoGPT's `configure_optimizers`, trained under fully_shard in a gloo
group (`run_shapes_world`) and in one process (`train_reference`), for test_parallel_shapes.py.

The model is no other test's: a pre-norm GPT with a token embedding tied to the head (the root
unit), biases, LayerNorms, and a 0-dim temperature; widths chosen so that no first dimension
(vocab 17, width 10, 3 * width 30, 4 * width 40, seq 7) is a multiple of both 2 and 3, so ranks own
unequal rows and some parameters are padded."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from tests.trainer import _parallel_harness as harness

VOCAB, WIDTH, HEADS, SEQ, DEPTH = 17, 10, 2, 7, 2
BATCH, STEPS = 6, 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        # No bias (nanoGPT's bias=False): the key bias gets a zero gradient in exact arithmetic
        # (it shifts a query's scores equally), so AdamW turns rounding noise into full steps.
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.mlp_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyNanoGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(SEQ, WIDTH)
        self.h = nn.ModuleList(_Block() for _ in range(DEPTH))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as nanoGPT: a parameter of the root unit
        self.temperature = nn.Parameter(torch.tensor(1.5))  # 0-dim

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x)) / self.temperature


def configure_optimizers(
    model: nn.Module, weight_decay: float, learning_rate: float, betas: tuple[float, float], foreach: bool
) -> torch.optim.Optimizer:
    """nanoGPT's GPT.configure_optimizers (model.py), `self` being the (wrapped) model."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    # any parameters that is 2D will be weight decayed, otherwise no.
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, foreach=foreach)


def groups_by_name(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay chosen by parameter name (as minGPT's configure_optimizers decides it, but from
    named_parameters() alone): none for biases, LayerNorms, embeddings and the temperature."""
    no_decay = (
        "bias",
        "ln_1.weight",
        "ln_2.weight",
        "ln_f.weight",
        "wte.weight",
        "wpe.weight",
        "temperature",
    )
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
    ]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train(model: nn.Module, case: dict[str, Any], rank: int, size: int) -> list[float]:
    """nanoGPT's loop on this rank's slice of each global batch; the global mean loss per step.
    precision "fp16": with a gradient scaler (ShardedGradScaler when sharded), as nanoGPT's
    GradScaler; the one-process reference runs the same loop under torch.autocast itself."""
    if case.get("optimizer") == "sgd":  # groups by name, SGD with momentum
        groups = groups_by_name(model, 0.1)
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=case["foreach"])
    else:
        optimizer = configure_optimizers(model, 0.1, 3e-2, (0.9, 0.95), case["foreach"])
    precision = case.get("precision")
    scaler: Any = None
    if precision == "fp16":
        scaler = ShardedGradScaler("cpu") if size > 1 else torch.amp.GradScaler("cpu")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision or "")
    # The wrapper runs its forward under autocast itself (mixed_precision=); one process needs it.
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype is not None and size == 1)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        per = BATCH // size
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().double().reshape(1)
        if size > 1:
            dist.all_reduce(total)
        losses.append(float(total) / size)
    return losses


def fresh_model() -> TinyNanoGPT:
    torch.manual_seed(0)
    return TinyNanoGPT()


def train_reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = fresh_model()
    losses = train(model, case, 0, 1)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run_case(case: dict[str, Any]) -> dict[str, Any]:
    from dtjob.trainer.parallel import full_state_dict, fully_shard

    rank, size = dist.get_rank(), dist.get_world_size()
    plain = fresh_model()
    expected = [(n, tuple(p.shape), p.dim(), tuple(p.shape)) for n, p in plain.named_parameters()]
    # units: the blocks h.0, h.1
    model = fully_shard(fresh_model(), zero_stage=case["stage"], mixed_precision=case.get("precision"))
    seen = _shapes(model)
    losses = train(model, case, rank, size)
    return {
        "expected": expected,
        "seen": seen,
        "seen_after": _shapes(model),
        "losses": losses,
        "state": full_state_dict(model),
    }


def _shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...], int, tuple[int, ...] | None]]:
    """(name, shape, dim, the local tensor's shape if a DTensor) of each named parameter."""
    return [
        (n, tuple(p.shape), p.dim(), tuple(p.to_local().shape) if isinstance(p, DTensor) else None)
        for n, p in model.named_parameters()
    ]


def run_shapes_world(size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every case in one gloo group of `size` processes; each rank's results by case name."""
    return harness.run_world(size, cases, run_case=_run_case)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12)) if b.numel() else 0.0
