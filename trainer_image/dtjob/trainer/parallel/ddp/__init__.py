"""Distributed data parallel: replicated model, bucketed and overlapped gradient all-reduce."""

from dtjob.trainer.parallel.ddp.buckets import Bucket, assign_buckets
from dtjob.trainer.parallel.ddp.module import DataParallel, data_parallel

__all__ = ["Bucket", "DataParallel", "assign_buckets", "data_parallel"]
