"""Batch size by memory: the largest micro-batch that fits a device, and
the exact split of a target global batch into micro-batches, replicas and
accumulation steps."""

from keras_mgpu.batch_size.configure import BatchSetup, configure_batch
from keras_mgpu.batch_size.finder import (
    BatchSizeResult,
    find_batch_size,
)
from keras_mgpu.batch_size.memory_probe import AllocatorStatsUnavailable
from keras_mgpu.batch_size.plan import BatchPlan, NoExactSplitError, plan_batch

__all__ = [
    "AllocatorStatsUnavailable",
    "BatchPlan",
    "BatchSetup",
    "BatchSizeResult",
    "NoExactSplitError",
    "configure_batch",
    "find_batch_size",
    "plan_batch",
]
