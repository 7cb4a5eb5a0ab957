"""Keras config serialization that leaves TensorFlow unimported.

Keras 3.15's `keras.saving.serialize_keras_object` asks its lazy
`tensorflow` module whether TensorFlow is available (to convert a
`tf.TensorShape`, `tf.DType` or `tf.TypeSpec`) for every object that is not
a plain value, and asking imports TensorFlow wherever it is installed: a
JAX run that copies a model or an optimizer from its config (the batch-size
probe, `check_layout_map`'s optimizer estimate) would load TensorFlow and
oneDNN, against the JAX guide's promise.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def tensorflow_left_alone() -> Iterator[None]:
    """Within the block, Keras's serialization treats TensorFlow as
    unavailable while it is not imported yet.

    Nothing is lost: an object of a TensorFlow class exists only once
    TensorFlow is imported, and then the block changes nothing. Where
    Keras's private lazy module is not what this expects (another Keras
    version), the block changes nothing either: Keras imports TensorFlow as
    before. While the block runs, another thread asking Keras whether
    TensorFlow is available is told no.

    Example:

    ```python
    with tensorflow_left_alone():
        config = keras.saving.serialize_keras_object(model)
    ```
    """
    lazy = _keras_lazy_tensorflow()
    if lazy is None or "tensorflow" in sys.modules:
        yield
        return
    lazy._available = False
    try:
        yield
    finally:
        # Asked again later (say, once the user imports TensorFlow for
        # `tf.data`), Keras looks again.
        if lazy._available is False:
            lazy._available = None


def _keras_lazy_tensorflow():
    """Keras 3.15's `keras.src.utils.module_utils.tensorflow`, a
    `LazyModule` whose `_available` is None until first asked; None where
    it is not that (Keras's layout changed, or it was asked already)."""
    try:
        from keras.src.utils import module_utils
    except ImportError:
        return None
    lazy = getattr(module_utils, "tensorflow", None)
    if (
        type(lazy).__name__ != "LazyModule"
        or getattr(lazy, "name", None) != "tensorflow"
        or getattr(lazy, "module", "missing") is not None
        or getattr(lazy, "_available", "missing") is not None
    ):
        return None
    return lazy
