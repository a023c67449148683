"""Parallel training of any `nn.Module` on dtjob's collectives, used in the user's own loop.

    model = data_parallel(model)                  # DDP: replicated, gradients averaged in backward
    model = fully_shard(model, zero_stage=3)      # ZeRO 1/2/3, sharded by rows
    pipe = pipeline(model, stages=2, microbatches=4, schedule="1f1b")   # GPipe / 1F1B, DP x PP
    state = full_state_dict(model)                # the unsharded weights on rank 0
    model = tensor_parallel(model, plan="auto")   # Megatron TP, in place (tp/)
    m = mesh(dp=2, tp=2, pp=2)                    # 3-D: groups for tensor_parallel/pipeline/fully_shard

`torch.distributed` must be initialised first; each wrapper spans the default process group
(or `group=`). Every rank passes an identically constructed model on its device. The wrappers
report their local state through `local_shards()` (see shards.py), so a checkpoint written with
one wrapper at one world size loads into another at another (the pipeline needs the same stages).

Layout: comm.py (the data path: dtjob collectives or native), common.py (shared pieces),
clip.py (gradient norms over shards), ddp/, fsdp/ (ZeRO 1/2/3), pp/ (pipeline: GPipe, 1F1B, DP x PP),
tp/ (tensor parallel), mesh3d.py (the 3-D mesh's groups), state_dict.py (full_state_dict), syncbn.py
(nn.SyncBatchNorm over a wrapper's replica group), memory.py (tensor bytes counted on the CPU, for
the tests' and bench/memory3d.py's memory figures).

Buffers (BatchNorm's running statistics) are rank 0's of each replica group: broadcast before a
forward as torch's DDP does (`broadcast_buffers=True`, common.BufferBroadcast), and a checkpoint
holds rank 0's.

Limits: ZeRO gives the single-process result for elementwise optimizers (SGD, Adam, AdamW, ...),
since each rank updates its own pieces of the parameters; every rank's forward must call the same
units in the same order (their collectives are issued in that order); batches split evenly, so that
means of means equal the global mean.
"""

from __future__ import annotations

from dtjob.trainer.parallel.clip import clip_grad_norm_
from dtjob.trainer.parallel.comm import COLLECTIVES, Comm
from dtjob.trainer.parallel.ddp import DataParallel, data_parallel
from dtjob.trainer.parallel.fsdp import FullyShardedModule, fully_shard
from dtjob.trainer.parallel.mesh3d import Mesh, mesh
from dtjob.trainer.parallel.pp import Pipeline, pipeline
from dtjob.trainer.parallel.shards import FetchRange, FlatShard, LocalShard, Sharded
from dtjob.trainer.parallel.state_dict import full_state_dict
from dtjob.trainer.parallel.tp import tensor_parallel, vocab_parallel_cross_entropy

__all__ = [
    "COLLECTIVES",
    "Comm",
    "DataParallel",
    "FetchRange",
    "FlatShard",
    "FullyShardedModule",
    "LocalShard",
    "Mesh",
    "Pipeline",
    "Sharded",
    "clip_grad_norm_",
    "data_parallel",
    "full_state_dict",
    "fully_shard",
    "mesh",
    "pipeline",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
]
