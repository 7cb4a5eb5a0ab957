"""Limits of Keras 3.15 / TensorFlow 2.21 that placement works around.

None of these uses a keras_mgpu component: each builds a model placed by
hand (`tf.device` while building and calling its layers, the usual recipe)
and asserts that plain Keras still misplaces the work the way it was
measured, so that a release fixing it makes the test fail and the README's
"Keras/TensorFlow limits" list can shrink.
"""

from __future__ import annotations

import pytest
from _placement_helpers import (
    CPUS,
    canonical,
    compute_op,
    data,
    placed_nodes,
    transfers,
)

from keras_mgpu import _flavour

keras = _flavour.keras
tf = _flavour.tf

pytestmark = pytest.mark.keras_limit


class _OnDevice(keras.layers.Layer):
    """The usual hand-made placement: build and call under `tf.device`."""

    def __init__(self, units, device, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, activation="relu")
        self.device = device

    def build(self, input_shape):
        with tf.device(self.device):
            self.dense.build(input_shape)

    def call(self, inputs):
        with tf.device(self.device):
            return self.dense(inputs)


def _hand_placed_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    x = _OnDevice(16, CPUS[1], name="on_cpu_1")(inputs)
    outputs = _OnDevice(3, CPUS[2], name="on_cpu_2")(x)
    return keras.Model(inputs, outputs, name="hand_placed")


@pytest.mark.slow
def test_hand_placed_model_trains_its_backward_and_optimizer_on_device_0():
    model = _hand_placed_model()
    assert {canonical(v.value.device) for v in model.weights} == {
        "/device:CPU:1",
        "/device:CPU:2",
    }
    model.compile(optimizer="adam", loss="mse")
    x, y = data(16)
    nodes = placed_nodes(lambda: model.fit(x, y, batch_size=8, verbose=0))
    # (1) TensorFlow puts gradient ops on the default device, not next to
    # their forward ops: the backward pass of both stages runs on cpu:0.
    backward = {
        canonical(n.device)
        for n in nodes
        if compute_op(n.op) in ("MatMul", "ReluGrad", "BiasAddGrad")
        and "gradient_tape" in n.name
        and "hand_placed" in n.name
    }
    assert backward == {"/device:CPU:0"}
    # (2) Keras builds the optimizer inside the first step's graph, where
    # the colocation with each variable is lost: every slot on cpu:0.
    slots = [v for v in model.optimizer.variables if len(v.shape)]
    assert {canonical(v.value.device) for v in slots} == {"/device:CPU:0"}
    # (3) ...so each step sends the stages' data to cpu:0 and back.
    crossings = {(s, t) for s, t, _ in transfers(nodes)}
    assert ("/device:CPU:0", "/device:CPU:1") in crossings
    assert ("/device:CPU:0", "/device:CPU:2") in crossings


def test_one_replica_gradient_all_reduce_is_one_op_over_every_gradient():
    """Keras's optimizer sums the gradients over replicas through
    `ReplicaContext.all_reduce`, one IdentityN op (its custom gradient) over
    all of them: with one replica it is the identity, yet one device."""
    with tf.device(CPUS[1]):
        a = tf.Variable(tf.ones((4, 4)))
    with tf.device(CPUS[2]):
        b = tf.Variable(tf.ones((4, 4)))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build([a, b])

    @tf.function
    def reduce():
        with tf.device(CPUS[1]):
            ga = tf.ones((4, 4))
        with tf.device(CPUS[2]):
            gb = tf.ones((4, 4))
        pairs = optimizer._all_reduce_sum_gradients([(ga, a), (gb, b)])
        return [g for g, _ in pairs]

    graph = reduce.get_concrete_function().graph
    kinds = {op.type for op in graph.get_operations()}
    assert "IdentityN" in kinds
    identity = [op for op in graph.get_operations() if op.type == "IdentityN"]
    assert len(identity) == 1 and len(identity[0].inputs) >= 2
