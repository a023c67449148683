"""A multi-layer perceptron classifier: features (batch, inputs) -> logits (batch, classes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    inputs: int = 32
    hidden: int = 64
    classes: int = 10
    depth: int = 3  # number of Linear layers (>= 1)

    def __post_init__(self) -> None:
        for name in ("inputs", "hidden", "classes", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLPConfig.{name} must be >= 1, got {getattr(self, name)}")


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        widths = [cfg.inputs] + [cfg.hidden] * (cfg.depth - 1) + [cfg.classes]
        layers: list[nn.Module] = []
        for i in range(cfg.depth):
            last = i == cfg.depth - 1
            linear = nn.Linear(widths[i], widths[i + 1])
            layers.append(linear if last else nn.Sequential(linear, nn.GELU()))
        self.layers = nn.ModuleList(layers)

    def blocks_in_order(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
