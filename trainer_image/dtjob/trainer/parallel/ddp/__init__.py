"""Distributed data parallel: replicated model, bucketed and overlapped gradient all-reduce."""

from dtjob.trainer.parallel.ddp.buckets import Bucket, assign_buckets
from dtjob.trainer.parallel.ddp.strategy import DDPStrategy

__all__ = ["Bucket", "DDPStrategy", "assign_buckets"]
