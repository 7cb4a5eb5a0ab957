"""A custom training loop under a strategy that records, per update, the
weights and the bytes each replica sent (CrossDeviceByteCounter)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras
from keras_mgpu.compression import CrossDeviceByteCounter


def mlp(seed: int = 7) -> keras.Model:
    """12 -> 32 -> 32 -> 1: two kernels PowerSGD compresses, 3 that it
    does not (biases) and one it does not (32x1)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def regression(samples: int, seed: int = 0, features: int = 12):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = np.sin(x[:, :1] + x[:, 1:2]).astype("float32")
    return x, y


class Loop:
    """`model` trained by `GradientAccumulationOptimizer(inner, K,
    compression=...)` under `strategy`, one global micro-batch per call to
    `micro_step` (Keras's loss divides by the replicas, as in `fit`)."""

    def __init__(
        self,
        strategy,
        model_fn,
        inner_fn,
        compression=None,
        accumulation: int = 1,
        loss=None,
        count_bytes: bool = True,
        **optimizer_kwargs,
    ):
        self.strategy = strategy
        self.counter = CrossDeviceByteCounter(strategy) if count_bytes else None
        with strategy.scope():
            self.model = model_fn()
            self.optimizer = GradientAccumulationOptimizer(
                inner_fn(),
                accumulation,
                compression=compression,
                **optimizer_kwargs,
            )
            self.loss = loss or keras.losses.MeanSquaredError()
        self._step = tf.function(self._replica_step_all)

    def _replica_step_all(self, x, y):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = self.loss(yb, self.model(xb, training=True))
            variables = self.model.trainable_variables
            grads = tape.gradient(loss, variables)
            self.optimizer.apply(grads, variables)

        self.strategy.run(replica, args=(x, y))

    def micro_step(self, x, y) -> None:
        dataset = self.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(len(x))
        )
        for xb, yb in dataset:
            self._step(xb, yb)

    def weights(self) -> list:
        return [np.array(w) for w in self.model.get_weights()]

    def replica_copies_agree(self) -> bool:
        """Every replica holds the same value of every model variable."""
        for variable in self.model.trainable_variables:
            copies = self.strategy.experimental_local_results(variable.value)
            if any(
                not np.array_equal(np.asarray(c), np.asarray(copies[0]))
                for c in copies
            ):
                return False
        return True

    def close(self) -> None:
        if self.counter is not None:
            self.counter.remove()
