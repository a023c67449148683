"""Tensor parallelism (Megatron-style) on dtjob's collectives: `tensor_parallel(model, plan)`
splits the planned nn.Linear / Conv1D / nn.Embedding layers across a group's ranks in place;
`vocab_parallel_cross_entropy` is the loss of a vocabulary-split LM head.

Layout: ops.py (the autograd collectives and the vocab-parallel loss), layers.py (splitting one
module), plans.py (the built-in GPT-2 and Llama plans), module.py (tensor_parallel itself and the
full state dict)."""

from __future__ import annotations

from dtjob.trainer.parallel.tp.module import TPState, tensor_parallel, tp_state
from dtjob.trainer.parallel.tp.ops import vocab_parallel_cross_entropy

__all__ = ["TPState", "tensor_parallel", "tp_state", "vocab_parallel_cross_entropy"]
