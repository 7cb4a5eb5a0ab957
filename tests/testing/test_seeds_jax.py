"""`keras_mgpu.testing.set_random_seed` seeds Keras on JAX as
`keras.utils.set_random_seed` does, without importing TensorFlow (which
Keras's own function imports whenever it is installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_SCRIPT = """
import sys
import keras
import numpy as np
import keras_mgpu.testing

def draw():
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    dropout = keras.layers.Dropout(0.5)
    mask = dropout(np.ones((2, 8), "float32"), training=True)
    return [np.asarray(layer.kernel), np.asarray(mask),
            np.asarray(keras.random.uniform((3,))), np.random.rand(2)]

keras_mgpu.testing.set_random_seed(7)
ours = draw()
print("TF after ours", "tensorflow" in sys.modules)
keras.utils.set_random_seed(7)
theirs = draw()
print("TF after keras", "tensorflow" in sys.modules)
print("SAME", all(np.array_equal(a, b) for a, b in zip(ours, theirs)))
"""


@pytest.fixture(scope="module")
def seeded_output():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.slow
def test_same_numbers_as_keras_without_tensorflow(seeded_output):
    assert "TF after ours False" in seeded_output
    assert "SAME True" in seeded_output


@pytest.mark.slow
@pytest.mark.keras_limit
def test_keras_set_random_seed_imports_tensorflow_on_jax(seeded_output):
    # Keras 3.15 `keras.utils.set_random_seed` seeds TensorFlow whenever it
    # is installed, importing it (seconds; GPU memory on a GPU machine) even
    # on the JAX backend. Fails when Keras stops doing so.
    assert "TF after keras True" in seeded_output


def test_the_seed_is_checked():
    import keras_mgpu.testing

    with pytest.raises(ValueError, match="Received: seed='1'"):
        keras_mgpu.testing.set_random_seed("1")
