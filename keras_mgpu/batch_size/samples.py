"""A few samples of the user's data, repeated to make a batch of any size.

The memory of a training step depends on the shapes and dtypes of a batch,
not on its values, so the probe repeats the samples it has: a batch of
1,000 from 32 samples is those 32, cycled.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from keras_mgpu._flavour import TF_RUNS, tf

_DATA_FORMS = (
    "an `x` array (or dict / list of arrays), an `(x, y)` or "
    "`(x, y, sample_weight)` tuple of them, or a tf.data.Dataset that "
    "yields such batches (as `model.fit` takes)"
)


class SampleBatches:
    """`batch(n)`: `(x, y, sample_weight)` with `n` samples each (`y` and
    `sample_weight` may be None), as NumPy structures.

    Args:
        data: see `_DATA_FORMS`. A Dataset contributes its first batch.
    """

    def __init__(self, data: Any) -> None:
        if data is None:
            raise TypeError(
                f"Argument `data` must be {_DATA_FORMS}. Received: data=None"
            )
        if _is_dataset(data):
            data = self._first_batch(data)
        parts = tuple(data) if isinstance(data, tuple) else (data,)
        if not 1 <= len(parts) <= 3:
            raise ValueError(
                f"Argument `data` must be {_DATA_FORMS}. Received: a tuple "
                f"of {len(parts)} items"
            )
        parts = parts + (None,) * (3 - len(parts))
        self._parts = tuple(
            None if part is None else _map_structure(_to_numpy, part)
            for part in parts
        )
        self.num_samples = self._count_samples()

    @staticmethod
    def _first_batch(dataset: Any) -> Any:
        for element in dataset.take(1):
            return element
        raise ValueError(
            "Argument `data` is an empty tf.data.Dataset: the probe needs "
            "at least one batch."
        )

    def _count_samples(self) -> int:
        counts = {
            leaf.shape[0] if leaf.ndim else None
            for part in self._parts
            if part is not None
            for leaf in _flatten(part)
        }
        if None in counts:
            raise ValueError(
                "Argument `data` has a scalar where arrays with a leading "
                f"sample axis are expected. It must be {_DATA_FORMS}."
            )
        if len(counts) != 1:
            raise ValueError(
                "Argument `data` must have the same number of samples in "
                f"every array. Received sample counts {sorted(counts)}"
            )
        count = counts.pop()
        if count < 1:
            raise ValueError(
                "Argument `data` holds no samples (its arrays have length 0)"
            )
        return int(count)

    def batch(self, batch_size: int) -> tuple:
        """`(x, y, sample_weight)` of `batch_size` samples, cycling."""
        index = np.arange(batch_size) % self.num_samples
        return tuple(
            None
            if part is None
            else _map_structure(lambda a: np.take(a, index, 0), part)
            for part in self._parts
        )


def _tensorflow_loaded() -> bool:
    # Off TensorFlow, a tf.data or tf.Tensor input can only exist once the
    # user imported TensorFlow: never import it to ask.
    return TF_RUNS or "tensorflow" in sys.modules


def _is_dataset(data: Any) -> bool:
    return _tensorflow_loaded() and isinstance(data, tf.data.Dataset)


def _map_structure(function: Any, structure: Any) -> Any:
    if TF_RUNS:
        return tf.nest.map_structure(function, structure)
    import keras

    return keras.tree.map_structure(function, structure)


def _flatten(structure: Any) -> list:
    if TF_RUNS:
        return tf.nest.flatten(structure)
    import keras

    return keras.tree.flatten(structure)


def _to_numpy(value: Any) -> np.ndarray:
    if _tensorflow_loaded() and isinstance(
        value, tf.RaggedTensor | tf.SparseTensor
    ):
        raise TypeError(
            "Argument `data` holds a ragged or sparse tensor: the memory "
            "probe needs dense arrays."
        )
    return np.asarray(value)
