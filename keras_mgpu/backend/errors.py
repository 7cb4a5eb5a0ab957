"""Errors the backend layer raises for the features above it to catch."""

from __future__ import annotations


class OutOfMemory(Exception):
    """The device ran out of memory during a training step (the step did
    not fit, whatever the budget says). Raised by the memory probes of each
    backend (`batch_size.memory_probe` on TensorFlow,
    `backend.jax.compiled_memory` on JAX) for `find_batch_size` to step
    down; `keras_mgpu.batch_size.search` re-exports it."""
