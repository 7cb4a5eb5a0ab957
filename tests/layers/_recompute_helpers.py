"""Shared builders for the RecomputeGrad tests (also used in worker bodies)."""

from __future__ import annotations

import numpy as np

from keras_mgpu import _flavour
from keras_mgpu.layers import RecomputeGrad

keras = _flavour.keras
tf = _flavour.tf

FEATURES = 8


def make_block(stochastic: bool, name: str = "block") -> keras.Sequential:
    """A small block.

    Deterministic: Dense-ReLU, LayerNormalization, Dense. Stochastic:
    Dense-ReLU, Dropout, BatchNormalization (moving statistics), Dense.
    """
    layers = [keras.layers.Dense(16, activation="relu")]
    if stochastic:
        layers += [
            keras.layers.Dropout(0.5, seed=7),
            keras.layers.BatchNormalization(),
        ]
    else:
        layers.append(keras.layers.LayerNormalization())
    layers.append(keras.layers.Dense(4))
    return keras.Sequential(layers, name=name)


def make_pair(stochastic: bool):
    """(plain, wrapped) models with identical weights and seed states."""
    plain = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            make_block(stochastic),
            keras.layers.Dense(1),
        ]
    )
    wrapped = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            RecomputeGrad(make_block(stochastic)),
            keras.layers.Dense(1),
        ]
    )
    copy_state(plain, wrapped)
    return plain, wrapped


def copy_state(source, target) -> None:
    """Assign every variable (weights and seed states) of source to target."""
    assert len(source.variables) == len(target.variables)
    for a, b in zip(source.variables, target.variables, strict=True):
        assert tuple(a.shape) == tuple(b.shape), (a.path, b.path)
        b.assign(a.value)


def data(n: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return x, y


def distributed_gradients(strategy, model, x):
    """Outputs, summed gradients and non-trainable weights after one step."""
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(len(x))
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    def replica_fn(inputs):
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=True)
            loss = tf.reduce_sum(tf.square(outputs))
        grads = tape.gradient(loss, model.trainable_variables)
        return loss, grads

    @tf.function
    def step(inputs):
        loss, grads = strategy.run(replica_fn, args=(inputs,))
        reduce = tf.distribute.ReduceOp.SUM
        return (
            strategy.reduce(reduce, loss, axis=None),
            [strategy.reduce(reduce, g, axis=None) for g in grads],
        )

    loss, grads = step(batch)
    states = [np.array(v.numpy()) for v in model.non_trainable_weights]
    return float(loss), [g.numpy() for g in grads], states
