"""Fully sharded data parallel with ZeRO stages 1, 2 and 3 (flat, evenly padded shards)."""

from dtjob.trainer.parallel.fsdp.flat import FlatUnit
from dtjob.trainer.parallel.fsdp.module import FullyShardedModule, auto_units, fully_shard

__all__ = ["FlatUnit", "FullyShardedModule", "auto_units", "fully_shard"]
