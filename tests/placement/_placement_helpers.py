"""Models, gradients and op-placement readers shared by the placement tests.

Where ops really ran is read from TensorFlow's run metadata (the placed,
partitioned graphs of each function), not from our own bookkeeping: the
names of the placed graph's nodes and the device each was given.
"""

from __future__ import annotations

import re

import numpy as np

from keras_mgpu import _flavour

keras = _flavour.keras
tf = _flavour.tf

FEATURES = 8
CPUS = [f"/cpu:{i}" for i in range(4)]
# Ops that do the arithmetic of a Dense stack, forward and backward, by
# their stock TensorFlow names. With oneDNN on (the default on CPUs with
# AVX512-VNNI or AMX), Grappler rewrites them into oneDNN kernels
# (`_MklMatMul`, `_MklNativeFusedMatMul`, `_MklFusedMatMul`, ...) and fuses
# the activation into the matmul: `compute_op` maps those back.
COMPUTE_OPS = (
    "MatMul",
    "FusedMatMul",
    "BiasAdd",
    "BiasAddGrad",
    "Relu",
    "ReluGrad",
    "Tanh",
    "TanhGrad",
)
_ONEDNN_PREFIX = re.compile(r"^_(?:MklNative|Mkl)?")


def compute_op(op: str) -> str | None:
    """The stock name of a Dense-stack arithmetic op type, oneDNN's and
    fused kernels included (`_MklNativeFusedMatMul` -> `FusedMatMul`), or
    None for any other op (constants, reads, transfers, ...)."""
    stock = _ONEDNN_PREFIX.sub("", op)
    return stock if stock in COMPUTE_OPS else None


def device_of(variable) -> str:
    """Canonical device of a variable, read from TensorFlow."""
    spec = tf.DeviceSpec.from_string(variable.value.device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def canonical(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type.upper()}:{spec.device_index}"


def data(samples: int = 24, features: int = FEATURES, outputs: int = 3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.normal(size=(samples, outputs)).astype("float32")
    return x, y


def staged_mlp(
    stages: int, dropout: float = 0.0, outputs: int = 3, name="staged_mlp"
):
    """A Dense stack whose layers are named after the stage they belong
    to when cut with `stage_cuts(stages)`: `s<k>_...`."""
    keras.utils.set_random_seed(11)
    layers = [keras.Input((FEATURES,), name="features")]
    for k in range(stages):
        layers.append(
            keras.layers.Dense(16 + 4 * k, activation="tanh", name=f"s{k}_a")
        )
        if dropout:
            layers.append(
                keras.layers.Dropout(dropout, seed=5 + k, name=f"s{k}_drop")
            )
        layers.append(
            keras.layers.Dense(12 + 2 * k, activation="relu", name=f"s{k}_b")
        )
    layers.append(keras.layers.Dense(outputs, name=f"s{stages - 1}_out"))
    return keras.Sequential(layers, name=name)


def stage_cuts(model) -> list[str]:
    """Cut points (layer names) that start each stage at `s<k>_a`."""
    return [layer.name for layer in model.layers if layer.name.endswith("_a")][
        1:
    ]


def loss_and_grads(model, x, y, training: bool = True):
    """Mean squared error and its gradients, eagerly."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_mean(tf.square(model(x, training=training) - y))
    grads = tape.gradient(loss, [x, *model.trainable_variables])
    return float(loss), [np.asarray(g) for g in grads]


def assert_grads_close(actual, expected, rtol=1e-5, atol=1e-6):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


def placed_nodes(run) -> list:
    """The nodes of every function `run()` instantiated, as placed and
    partitioned by TensorFlow (`NodeDef`s with their assigned `device`).

    The functions must be traced inside `run` (a fresh `tf.function`, or
    the first `fit` of a freshly compiled model): TensorFlow reports the
    partition graphs when it instantiates a function. Functions of other
    models may show up too (instantiated late): give the model a name of
    its own and look only at its nodes.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.export_run_metadata()  # drop anything collected before
    try:
        run()
    finally:
        metadata = ctx.export_run_metadata()
        ctx.disable_run_metadata()
    return [
        node
        for graph in metadata.function_graphs
        for partition in graph.partition_graphs
        for node in partition.node
    ]


def transfers(nodes) -> list[tuple[str, str, str]]:
    """(from device, to device, tensor name) of every data transfer
    between devices (control edges left out)."""
    found = []
    for node in nodes:
        if node.op != "_Send":
            continue
        name = node.attr["tensor_name"].s.decode()
        if "ControlEdges" in name:
            continue
        found.append(
            (
                canonical(node.attr["send_device"].s.decode()),
                canonical(node.attr["recv_device"].s.decode()),
                name,
            )
        )
    return found
