"""Models for the trainer: plain `nn.Module`s that know nothing of parallelism.

Each model is also a sequence of blocks (`model.blocks_in_order()`), which is how the pipeline
strategy cuts it into stages and how ZeRO-3 and activation checkpointing choose their units.
"""

from dtjob.trainer.models.gpt import GPT, GPTConfig
from dtjob.trainer.models.mlp import MLP, MLPConfig

__all__ = ["GPT", "MLP", "GPTConfig", "MLPConfig"]
