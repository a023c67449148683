"""dtjob's trainer: a torch-shaped library for any model, data and training loop, plus a built-in
trainer (`python -m dtjob.trainer`) that is one user of it.

    from dtjob.trainer import data_parallel, fully_shard, pipeline, full_state_dict, ElasticSession

data_parallel, fully_shard, pipeline, tensor_parallel, mesh and full_state_dict are documented in
dtjob.trainer.parallel; ElasticSession (the operator's elastic contract for any script) in
dtjob.trainer.session. The names are imported on first use, so `python -m dtjob.trainer
--bad-flag` answers before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtjob.trainer.data import GlobalBatchSampler as GlobalBatchSampler
    from dtjob.trainer.parallel import clip_grad_norm_ as clip_grad_norm_
    from dtjob.trainer.parallel import data_parallel as data_parallel
    from dtjob.trainer.parallel import full_state_dict as full_state_dict
    from dtjob.trainer.parallel import fully_shard as fully_shard
    from dtjob.trainer.parallel import mesh as mesh
    from dtjob.trainer.parallel import pipeline as pipeline
    from dtjob.trainer.parallel import tensor_parallel as tensor_parallel
    from dtjob.trainer.parallel import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
    from dtjob.trainer.session import ElasticSession as ElasticSession

_PUBLIC = {
    "data_parallel": "dtjob.trainer.parallel",
    "fully_shard": "dtjob.trainer.parallel",
    "pipeline": "dtjob.trainer.parallel",
    "full_state_dict": "dtjob.trainer.parallel",
    "clip_grad_norm_": "dtjob.trainer.parallel",
    "tensor_parallel": "dtjob.trainer.parallel",
    "mesh": "dtjob.trainer.parallel",
    "vocab_parallel_cross_entropy": "dtjob.trainer.parallel",
    "ElasticSession": "dtjob.trainer.session",
    "GlobalBatchSampler": "dtjob.trainer.data",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'dtjob.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
