"""A small GPT: token + position embedding, N pre-norm transformer blocks, final norm and head.

`GPT.forward(tokens)` maps int64 tokens `(batch, seq)` to logits `(batch, seq, vocab)`. The model
is exactly the composition of `blocks_in_order()`: `[Embedding, Block * depth, Head]`, each taking
the previous one's output, so a pipeline can run any contiguous slice of it on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    # The family tensor_parallel(model, "auto") looks up (parallel/tp/plans.py), as Hugging Face's.
    model_type: ClassVar[str] = "dtjob-gpt"
    vocab: int = 256
    width: int = 128  # model (residual stream) width
    depth: int = 4  # number of transformer blocks
    heads: int = 4  # attention heads; width must be a multiple of heads
    seq_len: int = 64  # longest sequence the position embedding covers
    mlp_ratio: int = 4  # hidden width of each block's MLP = mlp_ratio * width

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "depth", "heads", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig.width ({self.width}) must be a multiple of GPTConfig.heads ({self.heads})"
            )


class Embedding(nn.Module):
    """Tokens (batch, seq) -> residual stream (batch, seq, width)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.seq_len, cfg.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.seq_len:
            raise ValueError(f"sequence length {seq} exceeds GPTConfig.seq_len={self.seq_len}")
        pos = torch.arange(seq, device=tokens.device)
        return self.tokens(tokens) + self.positions(pos)


class CausalSelfAttention(nn.Module):
    """Heads follow from qkv's output width (-1 below), so a tensor-parallel split of qkv and proj
    (models/gpt.py's plan in parallel/tp/plans.py) runs this rank's heads unchanged."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.width // cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        shape = (b, t, -1, self.head_dim)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Residual stream -> logits over the vocabulary."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.width)
        self.out = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.head = Head(cfg)
        self._init_weights(cfg)

    def _init_weights(self, cfg: GPTConfig) -> None:
        # GPT-2's scheme: N(0, 0.02), residual projections scaled by 1/sqrt(2 * depth) so the
        # residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.depth) if name.endswith(("proj.weight", "2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def blocks_in_order(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for block in self.blocks_in_order():
            x = block(x)
        return x
