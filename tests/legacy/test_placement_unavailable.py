"""Placement is Keras 3 only: a tf_keras model says so; a Keras 3 model
works even in a TF_USE_LEGACY_KERAS=1 process (Ray Train sets it)."""

from __future__ import annotations

import keras as keras3
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu._flavour import keras


def test_placement_names_the_flavour_it_needs():
    model = keras.Sequential([keras.layers.Dense(2, input_shape=(3,))])
    for function in (
        keras_mgpu.apply_placement,
        keras_mgpu.strip_placement,
        keras_mgpu.placement_report,
    ):
        with pytest.raises(
            NotImplementedError,
            match=r"needs Keras 3 \(TensorFlow backend\); it is not "
            r"available under tf_keras \(TF_USE_LEGACY_KERAS=1\): give it a "
            r"Keras 3 model",
        ):
            function(model)


def test_a_keras3_model_is_placed_in_a_tf_keras_process():
    keras3.utils.set_random_seed(0)
    model = keras3.Sequential(
        [keras3.Input((3,)), keras3.layers.Dense(4), keras3.layers.Dense(1)]
    )
    placed = keras_mgpu.apply_placement(model, ["/cpu:0", "/cpu:1"])
    x = np.ones((4, 3), "float32")
    np.testing.assert_allclose(placed(x), model(x), rtol=1e-6)
    assert "/device:CPU:1" in placed.layers[-1].weights[0].value.device
