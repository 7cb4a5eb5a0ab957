"""Placement is Keras 3 only: under tf_keras it says so."""

from __future__ import annotations

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
            r"available under tf_keras \(TF_USE_LEGACY_KERAS=1\)",
        ):
            function(model)
