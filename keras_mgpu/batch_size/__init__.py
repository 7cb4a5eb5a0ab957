"""Batch size by memory: the largest micro-batch that fits a device, the
exact split of a target global batch into micro-batches, replicas and
accumulation steps, and (JAX) a plan of accumulation, recompute, offload
and state sharding for a memory budget (`plan_memory`)."""

from keras_mgpu.batch_size.configure import BatchSetup, configure_batch
from keras_mgpu.batch_size.finder import (
    BatchSizeResult,
    find_batch_size,
)
from keras_mgpu.batch_size.memory_plan import (
    MemoryCandidate,
    MemoryPlan,
    plan_memory,
)
from keras_mgpu.batch_size.memory_probe import AllocatorStatsUnavailable
from keras_mgpu.batch_size.plan import BatchPlan, NoExactSplitError, plan_batch

__all__ = [
    "AllocatorStatsUnavailable",
    "BatchPlan",
    "BatchSetup",
    "BatchSizeResult",
    "MemoryCandidate",
    "MemoryPlan",
    "NoExactSplitError",
    "configure_batch",
    "find_batch_size",
    "plan_batch",
    "plan_memory",
]
