"""`GradientAccumulationOptimizer(..., reduction="per_update")` on JAX: the
gradients cross devices once per accumulation window (issue 36 item 3).

Plain computation: the inner optimizer alone, one device, `fit` on the
large batch (`K` micro-batches of `R` devices' shards). The per-update runs
use `DataParallel` over the 4 CPU devices the test plugin sets up.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _training import max_abs_diff

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras
from keras_mgpu.backend.jax import reduction as reduction_lib
from keras_mgpu.backend.jax.collectives import (
    collectives_from_hlo,
    compiled_train_step,
)
from keras_mgpu.normalization import accept_micro_batch_statistics

STEPS = 2  # accumulation steps (K)
MICRO = 16  # global micro-batch, 4 samples per device
LARGE = STEPS * MICRO
TOLERANCE = 2e-6  # max abs weight difference

RNG = np.random.default_rng(11)
X = RNG.normal(size=(4 * LARGE, 6)).astype("float32")
Y = RNG.normal(size=(4 * LARGE, 4)).astype("float32")


def _schedule():
    # The rate changes after the first update: counting micro-steps would
    # show.
    return keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.1, 0.01])


INNER = {
    "sgd": lambda: keras.optimizers.SGD(_schedule(), momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(_schedule()),
}


def _data_parallel():
    return keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(4, name="out"),
        ]
    )


@functools.cache
def _large_batch(name: str) -> tuple:
    model = _model()
    model.compile(optimizer=INNER[name](), loss="mse")
    model.fit(X, Y, batch_size=LARGE, shuffle=False, verbose=0)
    return tuple(model.get_weights())


def _per_update(name="adam", x=X, y=Y, reduction="per_update", **compile_kw):
    """A model trained (one epoch, unshuffled) under DataParallel with
    accumulation, and its distribution; the epoch's logs on the model's
    `logs` attribute."""
    distribution = _data_parallel()
    with distribution.scope():
        model = _model()
        optimizer = GradientAccumulationOptimizer(
            INNER[name](), STEPS, reduction=reduction
        )
        model.compile(
            optimizer=optimizer, loss="mse", metrics=["mae"], **compile_kw
        )
        history = model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    model.logs = {k: v[-1] for k, v in history.history.items()}
    return model, distribution


@functools.cache
def _logs_of_keras_step(name: str) -> dict:
    """The epoch's loss and metric with Keras's own step ("auto"): the same
    weights at every micro-step, so the same logs."""
    return _per_update(name, reduction="auto")[0].logs


# ----------------------------------------------------------------------
# Exact against the large batch, in fit
# ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ("sgd", "adam"))
@pytest.mark.parametrize("steps_per_execution", (1, STEPS))
def test_fit_equals_the_large_batch(name, steps_per_execution):
    model, _ = _per_update(name, steps_per_execution=steps_per_execution)
    assert reduction_lib.is_installed(model)
    optimizer = model.optimizer
    assert int(optimizer.iterations) == len(X) // LARGE
    # One row per device, sharded over the data axis.
    accumulator = optimizer.accumulators[0]
    assert accumulator.shape == (4, 6, 8)
    assert "batch" in str(accumulator.value.sharding.spec)
    expected = _large_batch(name)
    assert max_abs_diff(model.get_weights(), expected) < TOLERANCE
    # Loss and metrics summed over devices, as Keras's step logs them.
    logs = _logs_of_keras_step(name)
    assert model.logs.keys() == logs.keys()
    for key, value in logs.items():
        np.testing.assert_allclose(model.logs[key], value, rtol=1e-5)
    assert max_abs_diff(expected, _model().get_weights()) > 1e-2  # it moved


def test_the_inner_optimizer_sees_the_global_mean():
    """Clipping (of the global mean), EMA, the static loss scale factor
    and a skipped non-finite window behave as with one large batch: the
    window holding a NaN sample (on one device only) is dropped whole."""

    def inner(**settings):
        return keras.optimizers.SGD(_schedule(), momentum=0.9, **settings)

    settings = dict(
        # The large batches' gradient norms are 0.76-0.81: the first update
        # is not clipped (where an unscaled gradient would show), the
        # others are.
        global_clipnorm=0.78,
        use_ema=True,
        ema_momentum=0.5,
        loss_scale_factor=8.0,
    )
    x, y = X.copy(), Y.copy()
    x[LARGE + 5] = np.nan  # the second window, one device's shard
    kept = np.r_[0:LARGE, 2 * LARGE : len(X)]

    def plain(**settings):
        model = _model()
        model.compile(optimizer=inner(**settings), loss="mse")
        model.fit(x[kept], y[kept], batch_size=LARGE, shuffle=False, verbose=0)
        return model.get_weights()

    with _data_parallel().scope():
        model = _model()
        optimizer = GradientAccumulationOptimizer(
            inner(**settings), STEPS, reduction="per_update"
        )
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert int(optimizer.skipped_updates) == 1
    assert int(optimizer.iterations) == len(X) // LARGE - 1
    expected = plain(**settings)
    assert max_abs_diff(model.get_weights(), expected) < TOLERANCE
    assert max_abs_diff(expected, plain()) > 1e-3  # the settings mattered


# ----------------------------------------------------------------------
# The compiled step's collectives
# ----------------------------------------------------------------------
def _reductions_by_computation(hlo: str) -> dict:
    """{computation header: [Collective, ...]} of the all-reduces in each
    computation of an HLO module's text."""
    blocks: dict = {}
    header = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            header = line
            blocks[header] = []
        elif header is not None:
            blocks[header].append(line)
    found = {}
    for header, lines in blocks.items():
        records = [
            c
            for c in collectives_from_hlo("\n".join(lines))
            if c.kind == "all-reduce"
        ]
        if records:
            found[header] = records
    return found


def _array_bytes(records) -> int:
    """Bytes of the non-scalar arrays reduced (gradients, not the loss's and
    metrics' sums)."""
    return sum(r.bytes - r.scalar_bytes for r in records)


def _reduction_layout(model) -> tuple:
    """(gradient bytes reduced in the step's main computation, in its
    other computations: the update branch) of the compiled train step."""
    hlo = compiled_train_step(model, X[:MICRO], Y[:MICRO]).as_text()
    assert "conditional(" in hlo  # the update is a branch of its own
    found = _reductions_by_computation(hlo)
    main = sum(_array_bytes(r) for h, r in found.items() if "ENTRY" in h)
    branches = sum(
        _array_bytes(r) for h, r in found.items() if "ENTRY" not in h
    )
    return main, branches


def test_one_gradient_reduction_per_update():
    """Per update of K micro-steps: the per-update step reduces the
    gradients only in the update branch (once per window), none in a
    micro-step that only accumulates; Keras's step, kept by
    `reduction="auto"`, reduces them in every micro-step (K per update)."""
    gradient_bytes = 4 * sum(
        int(np.prod(v.shape)) for v in _model().trainable_variables
    )
    model, distribution = _per_update()
    with distribution.scope():
        main, branches = _reduction_layout(model)
    assert (main, branches) == (0, gradient_bytes)

    today, distribution = _per_update(
        reduction="auto", x=X[:MICRO], y=Y[:MICRO]
    )
    with distribution.scope():
        main, branches = _reduction_layout(today)
    assert (main, branches) == (gradient_bytes, 0)


def test_batch_statistics_and_random_layers():
    """Moving statistics are averaged over devices (one reduction of their
    size per micro-step, beside the gradients' none); each device draws its
    own dropout mask; the seed state moves as on one device."""
    distribution = _data_parallel()
    with distribution.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.BatchNormalization(),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(4),
            ]
        )
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), STEPS, reduction="per_update"
            ),
            loss="mse",
        )
        accept_micro_batch_statistics(model)
        model.fit(X[:LARGE], Y[:LARGE], batch_size=MICRO, verbose=0)
        main, _ = _reduction_layout(model)
    moving = [v for v in model.non_trainable_variables if "moving" in v.path]
    assert main == 4 * sum(int(np.prod(v.shape)) for v in moving)
    seed = next(
        v for v in model.non_trainable_variables if "seed_generator" in v.path
    )
    assert int(np.asarray(seed.value)[1]) == STEPS  # one draw per step
    # Every device holds the same state (the index folded in is undone).
    copies = {tuple(np.asarray(s.data)) for s in seed.value.addressable_shards}
    assert len(copies) == 1

    # Each device's shard drops different units (the masks, read from the
    # per-device gradient of the first layer's bias, differ).
    import jax

    step = jax.jit(
        functools.partial(reduction_lib.per_device_train_step, model)
    )
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    with distribution.scope():
        _, (_, _, optimizer_values, _) = step(state, (X[:MICRO], Y[:MICRO]))
    # BatchNormalization's gamma, before the dropout: a unit dropped for
    # every sample of a device's shard has exactly zero gradient there.
    gamma = [v.path for v in model.trainable_variables].index(
        model.layers[1].gamma.path
    )
    index = [id(v) for v in model.optimizer.variables].index(
        id(model.optimizer.accumulators[gamma])
    )
    rows = np.asarray(optimizer_values[index])  # (4, 8): one row per device
    dropped = rows == 0.0
    assert dropped.any()
    assert len({tuple(r) for r in dropped}) > 1


# ----------------------------------------------------------------------
# State: save and resume in the middle of a window
# ----------------------------------------------------------------------
def test_resume_mid_window_from_a_keras_file(tmp_path):
    first, distribution = _per_update(x=X[:48], y=Y[:48])  # 3 micro-steps
    assert int(first.optimizer.pending_steps) == 1
    path = str(tmp_path / "mid.keras")
    first.save(path)
    with distribution.scope():
        loaded = keras.models.load_model(path)
        optimizer = loaded.optimizer
        assert optimizer.reduction == "per_update"
        assert int(optimizer.pending_steps) == 1
        assert int(optimizer.iterations) == 1
        assert (
            max_abs_diff(
                [a.numpy() for a in optimizer.accumulators],
                [a.numpy() for a in first.optimizer.accumulators],
            )
            == 0.0
        )
        assert np.abs(optimizer.accumulators[0].numpy()).max() > 0
        assert reduction_lib.is_installed(loaded)
        loaded.fit(X[48:], Y[48:], batch_size=MICRO, shuffle=False, verbose=0)
    assert max_abs_diff(loaded.get_weights(), _large_batch("adam")) < TOLERANCE


def test_built_by_hand_warns_and_stays_exact():
    """An optimizer built outside `fit` leaves Keras's step in place: the
    gradients arrive reduced, are spread over the rows, and the updates
    stay exact (one reduction per micro-step, said in a warning)."""
    distribution = _data_parallel()
    with distribution.scope():
        model = _model()
        optimizer = GradientAccumulationOptimizer(
            INNER["adam"](), STEPS, reduction="per_update"
        )
        model.compile(optimizer=optimizer, loss="mse")
        optimizer.build(model.trainable_variables)
        with pytest.warns(UserWarning, match="already reduced over devices"):
            model.fit(X, Y, batch_size=MICRO, shuffle=False, verbose=0)
    assert not reduction_lib.is_installed(model)
    assert max_abs_diff(model.get_weights(), _large_batch("adam")) < TOLERANCE


# ----------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------
def test_refusals():
    with pytest.raises(ValueError, match="`reduction` must be one of"):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(), 2, reduction="per_micro_step"
        )
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices("cpu")
    )
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["hidden/kernel"] = (None, "model")
    model_parallel = keras.distribution.ModelParallel(layout_map=layouts)
    with model_parallel.scope():
        with pytest.raises(ValueError, match="ModelParallel.*DataParallel"):
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(), 2, reduction="per_update"
            )

    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    with _data_parallel().scope():
        model = OwnStep([keras.Input((6,)), keras.layers.Dense(4)])
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.SGD(), 2, reduction="per_update"
            ),
            loss="mse",
        )
        with pytest.raises(ValueError, match="overrides `train_step`"):
            model.fit(X[:MICRO], Y[:MICRO], batch_size=MICRO, verbose=0)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with _data_parallel().scope():
            model = _model()
            model.compile(
                optimizer=GradientAccumulationOptimizer(
                    keras.optimizers.SGD(), 2, reduction="per_update"
                ),
                loss="mse",
            )
            with pytest.raises(ValueError, match="LossScaleOptimizer"):
                model.fit(X[:MICRO], Y[:MICRO], batch_size=MICRO, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_refused_where_keras_code_differs(monkeypatch):
    """The step follows private code of Keras's JAX trainer: on the
    installed Keras every function matches its fingerprint; where one does
    not (a Keras the step was not read from), construction refuses, naming
    it."""
    assert reduction_lib.check_keras_code() is None
    name = "JAXTrainer._update_metrics_variables"
    monkeypatch.setitem(
        reduction_lib.KNOWN_FINGERPRINTS, name, {"0" * 16: "3.99"}
    )
    with pytest.raises(ValueError, match=f"{name} differs from Keras 3.99"):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(), 2, reduction="per_update"
        )
    # reduction="auto" does not rely on that code.
    GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)


def test_config_round_trip():
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(), 2, reduction="per_update"
    )
    config = optimizer.get_config()
    assert config["reduction"] == "per_update"
    restored = GradientAccumulationOptimizer.from_config(config)
    assert restored.reduction == "per_update"
    plain = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    assert plain.reduction == "auto"
