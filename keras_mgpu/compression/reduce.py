"""Summing tensors over replicas, one collective per dtype."""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import tf


def all_reduce_sum(context: Any, tensors: list) -> list:
    """Sum `tensors` over the replicas (replica context), one batched
    all-reduce per dtype.

    `CollectiveAllReduce` (the default of `MirroredStrategy` and of
    `MultiWorkerMirroredStrategy`) packs a batch by concatenating it, which
    fails for mixed dtypes (TensorFlow 2.16-2.21); grouping keeps each
    launch to one dtype.
    """
    groups: dict = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    reduced: list = [None] * len(tensors)
    for indices in groups.values():
        results = context.all_reduce(
            tf.distribute.ReduceOp.SUM, [tensors[i] for i in indices]
        )
        for index, result in zip(indices, results):
            reduced[index] = result
    return reduced
