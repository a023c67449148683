"""From flags to objects: the model, the optimizer factory and the strategy's `ParallelConfig`."""

from __future__ import annotations

import torch
from torch import nn

from dtjob.trainer.config import TrainerConfig
from dtjob.trainer.data import VOCAB_SIZE
from dtjob.trainer.models import GPT, MLP, GPTConfig, MLPConfig
from dtjob.trainer.parallel import OptimizerFactory, ParallelConfig

# The MLP's hidden width relative to --dim, as in a transformer block's MLP.
_MLP_HIDDEN_RATIO = 4


class ByteMLP(nn.Module):
    """`--model mlp` as a language model: byte embedding, then the MLP at every position.

    It sees one byte and predicts the next (a learned bigram model), which is all an MLP without
    attention can do with a sequence; it exists to exercise the strategies on a second model.
    """

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, dim)
        self.mlp = MLP(
            MLPConfig(inputs=dim, hidden=_MLP_HIDDEN_RATIO * dim, classes=VOCAB_SIZE, depth=layers)
        )

    def blocks_in_order(self) -> list[nn.Module]:
        return [self.embed, *self.mlp.blocks_in_order()]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.mlp.blocks_in_order():
            x = block(x)
        return x


def build_model(c: TrainerConfig) -> nn.Module:
    """The same initial weights on every rank: seeded from --seed alone."""
    torch.manual_seed(c.seed)
    if c.model == "gpt":
        return GPT(GPTConfig(vocab=VOCAB_SIZE, width=c.dim, depth=c.layers, heads=c.heads, seq_len=c.seq_len))
    return ByteMLP(c.dim, c.layers)


def optimizer_factory(c: TrainerConfig) -> OptimizerFactory:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        # The learning rate is set before every step by the schedule; this value is never used.
        return torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)

    return make


def parallel_config(c: TrainerConfig) -> ParallelConfig:
    return ParallelConfig(
        strategy=c.strategy,
        zero_stage=c.zero_stage,
        pipeline_stages=c.pipeline_stages,
        microbatches=c.microbatches,
        schedule=c.schedule,
        collective=c.collective,
        precision=c.precision,
        grad_clip=c.grad_clip if c.grad_clip > 0 else None,
    )
