"""GradientAccumulationOptimizer behaves as a plain Keras optimizer would:
`set_weights`, raw `tf.Variable`s, `exclude_from_weight_decay`, the clipping
and weight-decay settings, and sparse gradients (issue 10).

Each comparison is against the plain inner optimizer applying the mean of
the micro-gradients once.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _training import assert_weights_close

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras, tf

RNG = np.random.default_rng(3)


def _micro_grads(steps: int, shape: tuple) -> list:
    return [RNG.normal(size=shape).astype("float32") for _ in range(steps)]


# ----------------------------------------------------------------------
# set_weights
# ----------------------------------------------------------------------
def _trained_mid_window():
    """A wrapper (Adam, K=3) after 4 micro-steps: one update, 1 pending."""
    variable = keras.Variable(np.ones((2, 3), "float32"))
    optimizer = GradientAccumulationOptimizer(keras.optimizers.Adam(0.1), 3)
    for grad in _micro_grads(4, (2, 3)):
        optimizer.apply([grad], [variable])
    return optimizer, variable


def test_set_weights_sets_the_inner_optimizer_state_too():
    source, source_variable = _trained_mid_window()
    variable = keras.Variable(source_variable.numpy())
    target = GradientAccumulationOptimizer(keras.optimizers.Adam(0.1), 3)
    target.build([variable])
    target.set_weights([v.numpy() for v in source.variables])
    for got, want in zip(target.variables, source.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(target.iterations) == 1  # the inner's update counter
    # Both continue identically (momentum, velocity, pending window).
    for grad in _micro_grads(5, (2, 3)):
        source.apply([grad], [source_variable])
        target.apply([grad], [variable])
    np.testing.assert_allclose(variable.numpy(), source_variable.numpy())


def test_set_weights_under_mirrored_keeps_the_window_sum():
    source, source_variable = _trained_mid_window()
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    with strategy.scope():
        variable = keras.Variable(source_variable.numpy())
        target = GradientAccumulationOptimizer(keras.optimizers.Adam(0.1), 3)
        target.build([variable])
    target.set_weights([v.numpy() for v in source.variables])
    for got, want in zip(target.accumulators, source.accumulators):
        # Read in cross-replica context: the sum over the replicas.
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


def test_set_weights_errors():
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match="has not yet been built"):
        optimizer.set_weights([])
    optimizer.build([keras.Variable(np.zeros((2,), "float32"))])
    weights = [v.numpy() for v in optimizer.variables]
    count = len(weights)
    with pytest.raises(
        ValueError,
        match=rf"Argument `weights` must hold {count} arrays.*Received: "
        rf"{count - 1} arrays",
    ):
        optimizer.set_weights(weights[:-1])
    weights[-3] = np.zeros((3,), "float32")  # the accumulator of shape (2,)
    with pytest.raises(ValueError, match=r"has shape \(2,\), not compatible"):
        optimizer.set_weights(weights)


# ----------------------------------------------------------------------
# Raw tf.Variables
# ----------------------------------------------------------------------
def test_raw_tf_variables_accumulate_like_keras_variables():
    grads = _micro_grads(3, (2, 2))
    raw = tf.Variable(np.ones((2, 2), "float32"))
    wrapped = keras.Variable(np.ones((2, 2), "float32"))
    optimizer = GradientAccumulationOptimizer(keras.optimizers.Adam(0.5), 3)
    for grad in grads:
        optimizer.apply([grad, grad], [raw, wrapped])
    reference = keras.Variable(np.ones((2, 2), "float32"))
    keras.optimizers.Adam(0.5).apply([np.mean(grads, axis=0)], [reference])
    np.testing.assert_allclose(raw.numpy(), reference.numpy(), rtol=1e-6)
    np.testing.assert_allclose(wrapped.numpy(), reference.numpy(), rtol=1e-6)
    raw_name = raw.name.split(":")[0]
    with pytest.warns(UserWarning, match=f"variables \\['{raw_name}'\\]"):
        optimizer.apply([None, grads[0]], [raw, wrapped])


# ----------------------------------------------------------------------
# Weight decay, clipping settings
# ----------------------------------------------------------------------
@pytest.mark.parametrize("by", ["var_list", "var_names"])
def test_exclude_from_weight_decay_reaches_the_inner(by):
    decayed = keras.Variable(2.0, name="decayed")
    excluded = keras.Variable(2.0, name="excluded")
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.AdamW(1.0, weight_decay=0.1), 2
    )
    if by == "var_list":
        optimizer.exclude_from_weight_decay(var_list=[excluded])
    else:
        optimizer.exclude_from_weight_decay(var_names=["excluded"])
    for _ in range(2):
        optimizer.apply([0.0, 0.0], [decayed, excluded])
    assert float(excluded.numpy()) == 2.0
    assert float(decayed.numpy()) == pytest.approx(2.0 - 2.0 * 0.1)


def test_clipping_and_weight_decay_settings_are_the_inner_ones():
    inner = keras.optimizers.SGD(0.1, clipnorm=0.5, weight_decay=0.01)
    optimizer = GradientAccumulationOptimizer(inner, 2)
    assert optimizer.clipnorm == 0.5
    assert optimizer.weight_decay == 0.01
    assert optimizer.global_clipnorm is None and optimizer.clipvalue is None
    optimizer.clipnorm = 0.25
    assert inner.clipnorm == 0.25
    clipped = optimizer._clip_gradients([tf.constant([3.0, 4.0])])
    np.testing.assert_allclose(clipped[0].numpy(), [0.15, 0.2], rtol=1e-6)
    # The wrapper's own config still holds no base settings.
    assert "clipnorm" not in optimizer.get_config()


# ----------------------------------------------------------------------
# Sparse gradients
# ----------------------------------------------------------------------
class ScatterUpdateOptimizer(keras.optimizers.Optimizer):
    """Sets each row that has a gradient to that gradient (non-additive),
    as the optimizer in Keras's optimizer_sparse_test does."""

    def __init__(self):
        super().__init__(learning_rate=0.001)

    def update_step(self, gradient, variable, learning_rate):
        self.assign(variable, tf.cast(gradient, variable.dtype))


def _slices(values, indices, rows=6):
    values = np.asarray(values, "float32")
    return tf.IndexedSlices(
        tf.constant(values), tf.constant(indices), (rows, values.shape[1])
    )


# Micro-batches looking up rows {0, 2}, {2, 3}, {3}: row 2 and 3 twice,
# rows 1, 4, 5 never.
_MICRO = [
    ([[1.0, 2.0], [3.0, -1.0]], [0, 2]),
    ([[0.5, 0.5], [2.0, 2.0]], [2, 3]),
    ([[-4.0, 1.0]], [3]),
]


def _window_mean_rows() -> tuple:
    dense = np.zeros((6, 2), "float32")
    for values, indices in _MICRO:
        np.add.at(dense, indices, np.asarray(values, "float32"))
    dense /= len(_MICRO)
    rows = [0, 2, 3]
    return dense, rows


def test_sparse_window_reaches_the_inner_as_slices_of_touched_rows():
    received = []

    class Spy(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            received.append(gradient)
            super().update_step(gradient, variable, learning_rate)

    variable = keras.Variable(np.ones((6, 2), "float32"))
    optimizer = GradientAccumulationOptimizer(Spy(1.0), len(_MICRO))
    for values, indices in _MICRO:
        optimizer.apply([_slices(values, indices)], [variable])
    (grad,) = received
    assert isinstance(grad, tf.IndexedSlices)
    dense, rows = _window_mean_rows()
    np.testing.assert_array_equal(np.sort(grad.indices.numpy()), rows)
    np.testing.assert_allclose(
        tf.convert_to_tensor(grad).numpy(), dense, rtol=1e-6
    )
    np.testing.assert_allclose(variable.numpy(), 1.0 - dense, rtol=1e-6)


def test_non_additive_sparse_update_leaves_untouched_rows():
    """Difference 5 of issue 10: rows without a gradient kept their value
    only when the gradient stayed sparse."""
    variable = keras.Variable(np.full((6, 2), 7.0, "float32"))
    optimizer = GradientAccumulationOptimizer(
        ScatterUpdateOptimizer(), len(_MICRO)
    )
    for values, indices in _MICRO:
        optimizer.apply([_slices(values, indices)], [variable])
    dense, rows = _window_mean_rows()
    expected = np.full((6, 2), 7.0, "float32")
    expected[rows] = dense[rows]
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-6)


_SPARSE_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    "adadelta": lambda: keras.optimizers.Adadelta(0.5),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "scatter_update": ScatterUpdateOptimizer,
}


def _sparse_writes(optimizer, apply) -> bool:
    """Whether `optimizer` writes a model variable with `tf.IndexedSlices`
    during `apply()` (the instrumentation of Keras's optimizer_sparse_test,
    on the optimizer that does the writes)."""
    sparse = []
    for method in ("assign", "assign_add", "assign_sub"):
        original = getattr(optimizer, method)

        def record(variable, value, original=original):
            sparse.append(isinstance(value, tf.IndexedSlices))
            return original(variable, value)

        setattr(optimizer, method, record)
    apply()
    return any(sparse)


@pytest.mark.parametrize("name", sorted(_SPARSE_OPTIMIZERS))
def test_sparse_updates_reach_the_inner(name):
    """The inner optimizer updates sparsely exactly where the plain
    optimizer does, and the result equals the plain optimizer applying the
    window's mean gradient (sparse, repeated rows summed)."""
    dense, rows = _window_mean_rows()
    mean = _slices(dense[rows], rows)
    plain_variable = keras.Variable(np.ones((6, 2), "float32"))
    plain = _SPARSE_OPTIMIZERS[name]()
    plain_sparse = _sparse_writes(
        plain, lambda: plain.apply([mean], [plain_variable])
    )

    variable = keras.Variable(np.ones((6, 2), "float32"))
    optimizer = GradientAccumulationOptimizer(
        _SPARSE_OPTIMIZERS[name](), len(_MICRO)
    )

    def apply_window():
        for values, indices in _MICRO:
            optimizer.apply([_slices(values, indices)], [variable])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # densification warnings
        assert _sparse_writes(optimizer.inner_optimizer, apply_window) == (
            plain_sparse
        )
    np.testing.assert_allclose(
        variable.numpy(), plain_variable.numpy(), rtol=1e-5, atol=1e-6
    )


def _embedding_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(20, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


_EMBEDDING_DATA = (
    np.random.default_rng(0).integers(0, 20, size=(24, 3)).astype("int32"),
    np.random.default_rng(1).normal(size=(24, 1)).astype("float32"),
)


def _adagrad(clip: bool):
    # clipnorm 0.3 acts on the mean gradient of these windows.
    return keras.optimizers.Adagrad(0.5, clipnorm=0.3 if clip else None)


def _embedding_fit(strategy, clip: bool, jit_compile: bool = False):
    x, y = _EMBEDDING_DATA
    with strategy.scope():
        model = _embedding_model()
        model.compile(
            optimizer=GradientAccumulationOptimizer(_adagrad(clip), 3),
            loss="mse",
            jit_compile=jit_compile,
        )
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


_dense_references: dict = {}


def _dense_embedding_reference(clip: bool):
    """Plain Adagrad at batch 12 on the dense gradient (once per setting):
    the large batch, free of Keras's unsummed repeated rows."""
    if clip not in _dense_references:
        x, y = _EMBEDDING_DATA
        model = _embedding_model()
        optimizer = _adagrad(clip)
        for _ in range(2):
            for start in range(0, 24, 12):
                xb, yb = x[start : start + 12], y[start : start + 12]
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(
                        keras.losses.mean_squared_error(yb, model(xb))
                    )
                grads = tape.gradient(loss, model.trainable_variables)
                grads = [tf.convert_to_tensor(g) for g in grads]
                optimizer.apply(grads, model.trainable_variables)
        _dense_references[clip] = model.get_weights()
    return _dense_references[clip]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "clip"),
    [
        ("default", True),
        ("default_xla", True),
        ("mirrored_2", True),
        ("mirrored_2", False),
        ("central_storage", False),
    ],
)
def test_embedding_training_matches_the_large_batch(setup, clip):
    """Sparse accumulation in `fit` (Embedding, Adagrad, K=3): equal to the
    plain optimizer on the large batch's dense gradient, on one device, with
    XLA, and with the replicas' rows reduced before the inner optimizer."""
    from conftest import make_strategy

    strategy = make_strategy(setup.removesuffix("_xla"))
    weights = _embedding_fit(strategy, clip, jit_compile=setup.endswith("xla"))
    assert_weights_close(
        weights, _dense_embedding_reference(clip), rtol=1e-5, atol=1e-6
    )


@pytest.mark.keras_limit
def test_keras_applies_repeated_sparse_rows_unsummed():
    """Keras 3.15: an `IndexedSlices` gradient with a repeated index (an
    Embedding row looked up twice) is applied without summing the repeats;
    for Adagrad (and any optimizer squaring the gradient) the result differs
    from the dense gradient. tf_keras deduplicates first, and so does the
    wrapper. Fails when Keras fixes it."""
    sparse_variable = keras.Variable(np.ones((3, 2), "float32"))
    dense_variable = keras.Variable(np.ones((3, 2), "float32"))
    grad = _slices([[1.0, 1.0], [2.0, 2.0]], [1, 1], rows=3)
    keras.optimizers.Adagrad(0.1).apply([grad], [sparse_variable])
    keras.optimizers.Adagrad(0.1).apply(
        [tf.convert_to_tensor(grad)], [dense_variable]
    )
    assert not np.allclose(sparse_variable.numpy(), dense_variable.numpy())
