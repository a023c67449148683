"""Parallel strategies on dtjob's collectives: DDP, FSDP (ZeRO 1/2/3) and pipeline (GPipe, 1F1B).

    strategy = parallelize(model, ParallelConfig(strategy="fsdp", zero_stage=3),
                           lambda params: torch.optim.AdamW(params, lr=3e-4))
    loss = strategy.train_step(inputs, targets)   # this rank's slice of the global batch

`torch.distributed` must be initialised first; the strategy spans the default process group.
Every rank passes an identically constructed model (rank 0's parameters are broadcast where a
strategy replicates them). The returned object implements `TrainStrategy` (see api.py) and
`CheckpointableStrategy` (see state.py). Checkpoint keys are the same for every strategy
("model.<name>", "optim.<name>.<state>"), so a checkpoint written by one strategy at one world
size loads into another strategy at another (the pipeline needs the same stage count).

Layout: comm.py (the data path: dtjob collectives or native), common.py (shared pieces),
ddp/, fsdp/ (ZeRO 1/2/3), pipeline/ (GPipe, 1F1B, DP x PP).

Limits: ZeRO-3 and the pipeline own each parameter in exactly one block (stage), so they reject a
parameter shared between two blocks (tied embedding and head; the pipeline only when the blocks
fall on different stages) with a ValueError naming it, while DDP and ZeRO-1/2 train it as one;
ZeRO gives the single-process result only for elementwise optimizers (SGD, Adam, AdamW, ...),
since it updates flat shards; the optimizer sees one parameter group (the factory receives the
parameters only); pipeline stages exchange a single tensor; every batch must split evenly (across
ranks, grad_accum parts and micro-batches), so that means of means equal the global mean.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from dtjob.trainer.parallel.api import TrainStrategy
from dtjob.trainer.parallel.comm import Comm
from dtjob.trainer.parallel.common import LossFn, OptimizerFactory, cross_entropy_loss
from dtjob.trainer.parallel.config import ParallelConfig
from dtjob.trainer.parallel.state import CheckpointableStrategy, FetchRange, FlatShard

__all__ = [
    "CheckpointableStrategy",
    "FetchRange",
    "FlatShard",
    "LossFn",
    "OptimizerFactory",
    "ParallelConfig",
    "TrainStrategy",
    "cross_entropy_loss",
    "parallelize",
]


def parallelize(
    model: nn.Module,
    config: ParallelConfig,
    optimizer_factory: OptimizerFactory,
    loss_fn: LossFn = cross_entropy_loss,
) -> TrainStrategy:
    """Wrap `model` for training across the default process group as `config` says.

    optimizer_factory: builds the optimizer from the parameters this rank updates (for ZeRO, its
        flat shards; for the pipeline, its stage's parameters). Any torch.optim optimizer whose
        update is elementwise (SGD, Adam, AdamW, ...) gives the single-process result.
    loss_fn(outputs, targets) -> the mean loss of a (micro-)batch; default: cross-entropy.
    """
    if not dist.is_initialized():
        raise RuntimeError("parallelize() needs torch.distributed.init_process_group() to be called first")
    if config.strategy == "ddp":
        from dtjob.trainer.parallel.ddp import DDPStrategy

        return DDPStrategy(model, config, optimizer_factory, loss_fn, Comm(config.collective))
    if config.strategy == "fsdp":
        from dtjob.trainer.parallel.fsdp import FSDPStrategy

        return FSDPStrategy(model, config, optimizer_factory, loss_fn, Comm(config.collective))
    from dtjob.trainer.parallel.pipeline import PipelineStrategy

    return PipelineStrategy(model, config, optimizer_factory, loss_fn)
