"""From flags to objects: the model (built in or the user's), the dataset, the wrapper, the optimizer.

User code: `--model pkg.module:factory` names a callable taking no arguments that returns the
`nn.Module`; its forward takes a batch of token ids (batch, seq) and returns logits
(batch, seq, vocab), or an output with `.logits` as transformers models do. `--data
pkg.module:factory` names a callable returning a map-style dataset whose items are 1-D tensors of
seq_len + 1 token ids (input and target are the window shifted by one), or (input, target) pairs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from dtjob.trainer.config import ConfigError, TrainerConfig, is_factory
from dtjob.trainer.data import VOCAB_SIZE, Corpus, DataError, TokenWindows
from dtjob.trainer.models import GPT, MLP, GPTConfig, MLPConfig
from dtjob.trainer.parallel import (
    Mesh,
    common,
    data_parallel,
    fully_shard,
    mesh,
    pipeline,
    tensor_parallel,
    vocab_parallel_cross_entropy,
)
from dtjob.trainer.parallel.tp.plans import has_auto_plan

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


def load_factory(text: str, flag: str) -> Callable[[], Any]:
    """The callable named by pkg.module:name (the working directory is importable, as for python -m)."""
    module_name, _, name = text.partition(":")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{flag} {text}: cannot import {module_name}: {err}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"{flag} {text}: {module_name} has no callable {name}")
    return factory


def build_model(c: TrainerConfig) -> nn.Module:
    """The same initial weights on every rank: seeded from --seed alone."""
    torch.manual_seed(c.seed)
    if c.model == "gpt":
        return GPT(GPTConfig(vocab=VOCAB_SIZE, width=c.dim, depth=c.layers, heads=c.heads, seq_len=c.seq_len))
    if c.model == "mlp":
        return ByteMLP(c.dim, c.layers)
    model = load_factory(c.model, "--model")()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {c.model}: the factory returned {type(model).__name__}, not an nn.Module")
    return model


def build_dataset(c: TrainerConfig) -> tuple[Dataset[Any], str, str]:
    """(dataset, its fingerprint for the cross-rank check, the sampler's shuffle mode)."""
    if c.data and is_factory(c.data):
        dataset = load_factory(c.data, "--data")()
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigError(
                f"--data {c.data}: the factory returned {type(dataset).__name__}, not a map-style dataset"
            )
        return dataset, f"{c.data}:{len(dataset)}", "epoch"
    try:
        corpus = Corpus.load(c.data)
        windows = TokenWindows(corpus, c.seq_len)
    except (DataError, OSError) as err:
        raise ConfigError(f"{err} (--data, env DTJOB_DATA)") from None
    # Every offset of the corpus is a sample: too many to permute, so each step draws its own.
    return windows, corpus.fingerprint, "replacement"


def inputs_and_targets(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch from dataset items: windows of seq_len + 1 tokens, or (input, target) pairs."""
    first = items[0]
    if isinstance(first, (tuple, list)) and len(first) == 2:
        return torch.stack([torch.as_tensor(i[0]) for i in items]), torch.stack(
            [torch.as_tensor(i[1]) for i in items]
        )
    if isinstance(first, torch.Tensor) and first.dim() == 1:
        rows = torch.stack(items)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    raise ConfigError(
        "--data: items must be 1-D tensors of seq_len + 1 token ids or (input, target) pairs, got "
        f"{type(first).__name__}"
    )


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of logits (or an output's .logits)."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def blocks(model: nn.Module) -> list[nn.Module]:
    return common.blocks_in_order(model) or common.repeated_blocks(model)


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Parallel:
    """The wrapped model, the loss its outputs take, and the mesh (None without --tensor-parallel)."""

    model: nn.Module
    loss: LossFn
    mesh: Mesh | None = None


def parallelize(model: nn.Module, c: TrainerConfig) -> Parallel:
    """--tensor-parallel T > 1: the mesh (dp = world / (T x P), tp = T, pp = P: P = --pipeline-stages
    under --strategy pipeline, else 1), the model split with tensor_parallel's plan "auto" over its
    TP group, then wrapped for --strategy over the data-parallel group (a pipeline over dp x pp).
    The vocab-split head's logits take vocab_parallel_cross_entropy (a pipeline's last stage's
    loss). T = 1: wrap() as ever."""
    if c.tensor_parallel == 1:
        return Parallel(wrap(model, c), lm_loss)
    if not has_auto_plan(model):
        raise ConfigError(
            f"--tensor-parallel {c.tensor_parallel}: tensor_parallel's plan='auto' does not know "
            f"--model {c.model} ({type(model).__name__}); use --model gpt, a Hugging Face GPT-2 or Llama, "
            "or your own loop with ElasticSession and tensor_parallel(model, plan={...}) with an "
            "explicit plan"
        )
    m = mesh(dp=c.data_parallel_size, tp=c.tensor_parallel, pp=c.stages)
    split = tensor_parallel(model, "auto", group=m.tp, collective=c.collective)

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = getattr(output, "logits", output)
        return vocab_parallel_cross_entropy(logits.float(), targets, m.tp)

    return Parallel(wrap(split, c, group=m.dp_pp if c.strategy == "pipeline" else m.dp, loss=loss), loss, m)


def wrap(model: nn.Module, c: TrainerConfig, *, group: Any = None, loss: LossFn | None = None) -> nn.Module:
    """The model wrapped for --strategy over `group` (default: the world), on the already
    initialised process group; `loss`: a pipeline's (default lm_loss)."""
    precision = None if c.precision == "fp32" else c.precision
    if c.activation_checkpointing:
        common.apply_activation_checkpointing(blocks(model))
    if c.strategy == "ddp":
        return data_parallel(
            model,
            collective=c.collective,
            bucket_mb=c.bucket_mb,
            first_bucket_mb=c.first_bucket_mb,
            grad_compression=c.grad_compression,
            mixed_precision=precision,
            group=group,
        )
    if c.strategy == "fsdp":
        return fully_shard(
            model,
            zero_stage=c.zero_stage,
            units=_names(c.units),
            collective=c.collective,
            mixed_precision=precision,
            prefetch=c.zero3_prefetch,
            group=group,
        )
    return pipeline(
        model,
        stages=c.pipeline_stages,
        microbatches=c.microbatches,
        schedule=c.schedule,
        split=_names(c.split),
        loss_fn=loss or lm_loss,
        collective=c.collective,
        mixed_precision=precision,
        group=group,
    )


def optimizer(wrapped: nn.Module, dims: dict[str, int], c: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only, not on biases and norms' gains. `dims` are the
    unwrapped parameters' dimensions by name (a ZeRO shard is 1-D whatever it belongs to)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in wrapped.named_parameters():
        (decay if dims[name] >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The learning rate follows the schedule (a LambdaLR over this peak value).
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=c.lr)
