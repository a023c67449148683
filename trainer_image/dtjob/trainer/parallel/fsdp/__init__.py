"""Fully sharded data parallel with ZeRO stages 1, 2 and 3 (flat, evenly padded shards)."""

from dtjob.trainer.parallel.fsdp.flat import FlatUnit
from dtjob.trainer.parallel.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPStrategy", "FlatUnit"]
