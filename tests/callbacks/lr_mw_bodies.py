"""Helpers for the learning-rate callback tests, and the multi-worker body.

`RecordingSGD` writes the learning rate that each update actually received
(the `learning_rate` argument of `update_step`) at index `iterations` of an
optimizer variable, so a test reads the learning rate of *every* update,
inside `steps_per_execution` and across a `BackupAndRestore` resume.
"""

from __future__ import annotations

import math

import numpy as np

from keras_mgpu._flavour import keras, tf

LOG_SIZE = 64


class RecordingSGD(keras.optimizers.SGD):
    """Plain SGD that logs the learning rate of every update."""

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.lr_log = self.add_variable(
            shape=(LOG_SIZE,),
            initializer="zeros",
            dtype="float32",
            name="lr_log",
            aggregation="only_first_replica",
        )

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        # Every variable writes the same value at the same index; this runs
        # before `iterations` is incremented, so index n is update n.
        index = tf.cast(self.iterations, tf.int32)
        lr = tf.cast(learning_rate, tf.float32)
        self.lr_log.assign(
            tf.tensor_scatter_nd_update(self.lr_log, [[index]], [lr])
        )

    def recorded(self) -> np.ndarray:
        return np.asarray(self.lr_log.numpy())[: int(self.iterations.numpy())]


def expected_warmup(n, warmup, initial, target, ramp):
    """Closed form of the warmup callback for update `n`."""
    if n >= warmup:
        return target
    fraction = n / warmup
    if ramp == "linear":
        return initial + (target - initial) * fraction
    if ramp == "cosine":
        return initial + (target - initial) * 0.5 * (
            1 - math.cos(math.pi * fraction)
        )
    return initial * (target / initial) ** fraction


def data(batches: int, batch_size: int, features: int = 3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * batch_size, features)).astype("float32")
    y = rng.normal(size=(batches * batch_size, 1)).astype("float32")
    return x, y


def tiny_model(features: int = 3):
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((features,)), keras.layers.Dense(1)])


def train_body(task_index: int) -> dict:
    """One MultiWorkerMirrored worker: scaler + warmup in a custom loop.

    Keras 3.15 `fit` fails under MultiWorkerMirrored (keras#20585), so the
    callbacks are driven by hand around `strategy.run`, as a custom training
    loop would.
    """
    from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tiny_model()
        optimizer = RecordingSGD(0.1)
        model.compile(optimizer=optimizer, loss="mse")
        optimizer.build(model.trainable_variables)
    callbacks = [
        LearningRateScaler(base_batch_size=4, per_replica_batch_size=4),
        LearningRateWarmup(warmup_steps=4, ramp="cosine"),
    ]
    for callback in callbacks:
        callback.set_model(model)
        callback.set_params({"epochs": 1, "steps": 6, "verbose": 0})
        callback.on_train_begin()

    x, y = data(6, 8)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )

    @tf.function
    def step(batch):
        def replica_step(inputs, targets):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(inputs) - targets))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        strategy.run(replica_step, args=batch)

    for batch in dataset:
        step(batch)
    logs = {}
    for callback in callbacks:
        callback.on_epoch_end(0, logs)
    for callback in callbacks:
        callback.on_train_end()
    return {
        "recorded": optimizer.recorded().tolist(),
        "factor": callbacks[0].factor,
        "logs_lr": logs["learning_rate"],
        "config_lr": optimizer.get_config()["learning_rate"],
        "replicas": strategy.num_replicas_in_sync,
    }
