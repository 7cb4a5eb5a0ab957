"""The strategy fixture builds every strategy and trains a tiny model."""

import numpy as np

from keras_mgpu import _flavour
from keras_mgpu.distribute import num_replicas_in_sync, strategy_kind

keras = _flavour.keras

EXPECTED = {
    "default": (1, "default"),
    "one_device": (1, "one_device"),
    "mirrored_2": (2, "mirrored"),
    "mirrored_4": (4, "mirrored"),
    "central_storage": (2, "central_storage"),
}


def test_strategy_matrix_trains(strategy, strategy_name):
    replicas, kind = EXPECTED[strategy_name]
    assert num_replicas_in_sync(strategy) == replicas
    assert strategy_kind(strategy) == kind
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 3), "float32")
    model.fit(x, np.ones((8, 1)), batch_size=4, epochs=1, verbose=0)
