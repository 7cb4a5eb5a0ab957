"""Seed every random source Keras draws from, without importing TensorFlow
on the JAX backend: tests (`keras_mgpu.testing.set_random_seed`) and the
seed a JAX cluster's processes agree on (`backend.jax.cluster`)."""

from __future__ import annotations

import random
import sys

import numpy as np


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy and Keras as `keras.utils.set_random_seed` does.

    `keras.utils.set_random_seed` also seeds TensorFlow whenever TensorFlow
    is installed, importing it (seconds, and GPU memory on a GPU machine)
    even on the JAX backend. Here TensorFlow is seeded only where it runs
    already (its backend, tf_keras, or imported by the test); on JAX the
    Keras seed state is set the way `set_random_seed` sets it (Keras 3.15),
    so initializers, `SeedGenerator`s and unseeded `keras.random` calls draw
    the same numbers as after `keras.utils.set_random_seed(seed)`.

    Args:
        seed: int, the seed.

    Example:

    ```python
    keras_mgpu.testing.set_random_seed(1234)  # in an autouse fixture
    ```
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(
            f"Argument `seed` must be an integer. Received: seed={seed!r}"
        )
    from keras_mgpu._flavour import keras

    if "tensorflow" in sys.modules or not _set_keras_seed_state(seed):
        keras.utils.set_random_seed(seed)
        return
    random.seed(seed)
    np.random.seed(seed)


def _set_keras_seed_state(seed: int) -> bool:
    """Set Keras's global seed and drop its global `SeedGenerator` (what
    `keras.utils.set_random_seed` does besides seeding the libraries).
    Private Keras state, read in Keras 3.15's `keras/src/utils/rng_utils.py`;
    False (the caller falls back to Keras's own function) where it moved."""
    try:
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
        from keras.src.utils import rng_utils
    except ImportError:
        return False
    names = (
        getattr(rng_utils, "GLOBAL_RANDOM_SEED", None),
        getattr(seed_generator, "GLOBAL_SEED_GENERATOR", None),
    )
    if names != ("global_random_seed", "global_seed_generator"):
        return False
    global_state.set_global_attribute(names[0], seed)
    global_state.set_global_attribute(names[1], None)
    return True
