"""Weight gradients of a pipelined step are summed micro-batch by
micro-batch (one running sum, not one AddN over all M), in graph mode,
and still equal the un-pipelined model's."""

from __future__ import annotations

import numpy as np
from _placement_helpers import CPUS, FEATURES, assert_grads_close, data

from keras_mgpu import _flavour
from keras_mgpu.placement import apply_placement

keras = _flavour.keras
tf = _flavour.tf

MICRO_BATCHES = 4


def _shared_layer_model():
    """A layer used twice per micro-batch (two calls per group)."""
    keras.utils.set_random_seed(6)
    inputs = keras.Input((FEATURES,))
    shared = keras.layers.Dense(FEATURES, activation="tanh", name="shared")
    x = shared(shared(inputs))
    x = keras.layers.Dense(8, activation="relu", name="mid")(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs)


def _graph_gradients(model, x, y, repeat=1):
    """Gradients in a tf.function; `repeat` asks a persistent tape twice."""

    @tf.function
    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        found = [
            tape.gradient(loss, model.trainable_variables)
            for _ in range(repeat)
        ]
        return found

    found = step(tf.constant(x), tf.constant(y))
    concrete = step.get_concrete_function(tf.constant(x), tf.constant(y))
    return [[np.asarray(g) for g in grads] for grads in found], concrete.graph


def test_graph_mode_gradients_equal_and_no_op_waits_for_every_micro_batch():
    model = _shared_layer_model()
    placed = apply_placement(
        model, CPUS[:3], policy=["mid", "head"], micro_batches=MICRO_BATCHES
    )
    x, y = data(10)
    (expected,), _ = _graph_gradients(model, x, y)
    (got_first, got_second), graph = _graph_gradients(placed, x, y, repeat=2)
    assert_grads_close(got_first, expected)
    assert_grads_close(got_second, expected)  # the tape asked twice
    # Without the running sum, the tape sums each weight's M gradients
    # (2M for the shared layer) with one AddN that waits for all of them.
    wide = [
        op.name
        for op in graph.get_operations()
        if op.type == "AddN" and len(op.inputs) >= MICRO_BATCHES
    ]
    assert not wide, wide
