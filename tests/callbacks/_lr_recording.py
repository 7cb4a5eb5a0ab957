"""The recording optimizer, model and data of the running backend, for the
LR callbacks' tests written once for both backends (the TensorFlow ones
aggregate their log for tf.distribute's replicas)."""

from __future__ import annotations

import keras
from callbacks import lr_jax_helpers, lr_mw_bodies

JAX = keras.backend.backend() == "jax"
_helpers = lr_jax_helpers if JAX else lr_mw_bodies
RecordingSGD = _helpers.RecordingSGD
data = _helpers.data
tiny_model = _helpers.tiny_model
expected_warmup = lr_jax_helpers.expected_warmup

__all__ = ["JAX", "RecordingSGD", "data", "expected_warmup", "tiny_model"]
