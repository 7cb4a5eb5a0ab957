"""GradientAccumulationOptimizer on Keras's JAX backend (`keras.distribution`).

Every equivalence is checked against the plain computation: one device, no
wrapper, one step of the inner optimizer on the large batch (the `K`
micro-batches concatenated), to float rounding.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu.backend import BackendNotSupportedError

STEPS = 2  # accumulation steps
MICRO = 16  # global micro-batch (over every device)
LARGE = STEPS * MICRO
TOLERANCE = 2e-6  # max abs weight difference (measured 3e-8 to 6e-8)

RNG = np.random.default_rng(7)
X = RNG.normal(size=(4 * MICRO, 6)).astype("float32")
Y = RNG.normal(size=(4 * MICRO, 4)).astype("float32")


def _schedule():
    # The rate changes after the first update: an optimizer counting
    # micro-steps (Keras's built-in accumulation) reads the second rate
    # already at its first update.
    return keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.1, 0.01])


INNER = {
    "sgd": lambda: keras.optimizers.SGD(_schedule(), momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(_schedule()),
    "adamw": lambda: keras.optimizers.AdamW(_schedule(), weight_decay=0.1),
}


def _data_parallel():
    return keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )


def _model_parallel():
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], keras.distribution.list_devices("cpu")
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")
    layout_map[".*hidden/bias"] = ("model",)
    layout_map[".*out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


DISTRIBUTIONS = {
    "none": lambda: None,
    "data_parallel": _data_parallel,
    "model_parallel": _model_parallel,
}


def _scope(distribution):
    return distribution.scope() if distribution else contextlib.nullcontext()


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(4, name="out"),
        ]
    )


def _fit(make_optimizer, distribution=None, batch_size=MICRO, x=X, y=Y, **kw):
    """A model trained one epoch, unshuffled; optimizer made in scope."""
    with _scope(distribution):
        model = _model()
        model.compile(optimizer=make_optimizer(), loss="mse", **kw)
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def _wrapped(name, steps=STEPS, **inner_kwargs):
    def make():
        inner = INNER[name]()
        for key, value in inner_kwargs.items():
            setattr(inner, key, value)
        return GradientAccumulationOptimizer(inner, steps)

    return make


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(a, b)
    )


def _loss(model, trainable, non_trainable, x, y):
    pred, non_trainable = model.stateless_call(trainable, non_trainable, x)
    return jnp.mean(jnp.square(pred - y)), non_trainable


def _plain_large_batch(make_inner):
    """The plain computation: the inner optimizer alone, one device, one
    `apply` per large batch of `K` micro-batches (eager, as Keras runs an
    optimizer outside `fit`); EMA weights swapped in at the end, as `fit`
    does."""
    model = _model()
    optimizer = make_inner()
    trainable = model.trainable_variables
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(values, x, y):
        return _loss(model, values, non_trainable, x, y)[0]

    for start in range(0, len(X), LARGE):
        batch = slice(start, start + LARGE)
        grads = jax.grad(loss)([v.value for v in trainable], X[batch], Y[batch])
        optimizer.apply(grads, trainable)
    optimizer.finalize_variable_values(trainable)
    return model.get_weights()


@pytest.fixture(scope="module")
def large_batch():
    """Weights after plain training on the large batch, per optimizer."""
    cache = {}

    def get(name, **inner_kwargs):
        key = (name, tuple(sorted(inner_kwargs.items())))
        if key not in cache:

            def make():
                inner = INNER[name]()
                for k, v in inner_kwargs.items():
                    setattr(inner, k, v)
                return inner

            cache[key] = _plain_large_batch(make)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def accumulated():
    """Models trained with the wrapper in fit, per (inner, distribution)."""
    cache = {}

    def get(inner, distribution):
        key = (inner, distribution)
        if key not in cache:
            dist = DISTRIBUTIONS[distribution]()
            cache[key] = _fit(_wrapped(inner), dist)
        return cache[key]

    return get


# ----------------------------------------------------------------------
# Exactness in fit
# ----------------------------------------------------------------------
@pytest.mark.parametrize("distribution", list(DISTRIBUTIONS))
def test_fit_equals_one_step_on_the_large_batch(
    large_batch, accumulated, distribution
):
    for inner in INNER:
        model = accumulated(inner, distribution)
        diff = _max_diff(model.get_weights(), large_batch(inner))
        assert diff < TOLERANCE, inner
        optimizer = model.optimizer
        # 4 micro-batches, 2 updates: schedules and `iterations` count
        # updates.
        assert int(optimizer.iterations) == 2
        assert int(optimizer.micro_steps) == 4
        assert int(optimizer.pending_steps) == 0
        assert int(optimizer.skipped_updates) == 0
        # Accumulators take their variable's layout (sharded under
        # ModelParallel, replicated under DataParallel).
        for variable, accumulator in zip(
            model.trainable_variables, optimizer.accumulators
        ):
            assert accumulator.value.sharding == variable.value.sharding
    if distribution == "model_parallel":
        kernel = model.get_layer("hidden").kernel
        assert tuple(kernel.value.sharding.spec) == (None, "model")
        accumulator = optimizer.accumulators[0]
        assert tuple(accumulator.value.sharding.spec) == (None, "model")


def test_fit_with_steps_per_execution(large_batch):
    dp = _fit(_wrapped("adam"), _data_parallel(), steps_per_execution=2)
    assert _max_diff(dp.get_weights(), large_batch("adam")) < TOLERANCE


@pytest.mark.slow
def test_fit_without_jit(large_batch):
    eager = _fit(_wrapped("adam"), jit_compile=False)
    assert _max_diff(eager.get_weights(), large_batch("adam")) < TOLERANCE


def test_ema_counts_updates(large_batch):
    """`use_ema` on the inner optimizer averages once per update; fit ends
    on the averages (`finalize_variable_values`), as without the wrapper."""
    ema = {"use_ema": True, "ema_momentum": 0.5}
    model = _fit(_wrapped("adam", **ema), _data_parallel())
    expected = large_batch("adam", **ema)
    assert _max_diff(model.get_weights(), expected) < TOLERANCE
    assert _max_diff(expected, large_batch("adam")) > 1e-3  # EMA mattered
    assert model.optimizer.use_ema


def test_under_mixed_float16_loss_scaling_wraps_the_wrapper(large_batch):
    """`compile` puts a LossScaleOptimizer around the wrapper; its
    stateless path reaches ours. float16 compute: agreement to its
    rounding, and the counters still count updates."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _fit(_wrapped("adam"), _data_parallel())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, GradientAccumulationOptimizer)
    assert int(optimizer.iterations) == 2
    assert int(optimizer.inner_optimizer.micro_steps) == 4
    assert _max_diff(model.get_weights(), large_batch("adam")) < 1e-3


# ----------------------------------------------------------------------
# Clipping applies to the accumulated (global) mean
# ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "clipping",
    [
        {"global_clipnorm": 0.05},
        pytest.param({"clipnorm": 0.05}, marks=pytest.mark.slow),
        pytest.param({"clipvalue": 0.01}, marks=pytest.mark.slow),
    ],
    ids=lambda clipping: next(iter(clipping)),
)
def test_clipping_applies_to_the_mean(large_batch, clipping):
    model = _fit(_wrapped("sgd", **clipping), _data_parallel())
    expected = large_batch("sgd", **clipping)
    assert _max_diff(model.get_weights(), expected) < TOLERANCE
    # The clip was active: the unclipped large batch ends elsewhere.
    assert _max_diff(expected, large_batch("sgd")) > 1e-3
    ((name, value),) = clipping.items()
    assert getattr(model.optimizer, name) == value  # the inner's


# ----------------------------------------------------------------------
# A custom JAX loop: stateless_call + jax.grad + stateless_apply in jit
# ----------------------------------------------------------------------
def _count_all_reduces(hlo: str) -> int:
    return len(re.findall(r"= [^\n]*all-reduce(?:-start)?\(", hlo))


def _sharded_batches(distribution, x, y, chunks):
    """`x`, `y` cut into `chunks` micro-batches, each split over the batch
    axis of the mesh."""
    xs = x.reshape(chunks, -1, x.shape[-1])
    ys = y.reshape(chunks, -1, y.shape[-1])
    layout = distribution.get_data_layout(xs.shape[1:])
    spec = jax.sharding.PartitionSpec(None, *layout.backend_layout.spec)
    sharding = jax.sharding.NamedSharding(layout.backend_layout.mesh, spec)
    return jax.device_put(xs, sharding), jax.device_put(ys, sharding)


def test_custom_stateless_loop(large_batch):
    dist = _data_parallel()
    with dist.scope():
        model = _model()
        optimizer = _wrapped("adam")()
        optimizer.build(model.trainable_variables)

        @jax.jit
        def micro_step(state, x, y):
            trainable, non_trainable, optimizer_values = state
            grad_fn = jax.value_and_grad(
                lambda t: _loss(model, t, non_trainable, x, y), has_aux=True
            )
            (_, non_trainable), grads = grad_fn(trainable)
            trainable, optimizer_values = optimizer.stateless_apply(
                optimizer_values, grads, trainable
            )
            return trainable, non_trainable, optimizer_values

        state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
        xs, ys = _sharded_batches(dist, X, Y, 4)
        for i in range(4):
            state = micro_step(state, xs[i], ys[i])
        for variable, value in zip(model.trainable_variables, state[0]):
            variable.assign(value)
        for variable, value in zip(optimizer.variables, state[2]):
            variable.assign(value)
        hlo = micro_step.lower(state, xs[0], ys[0]).compile().as_text()
    assert _max_diff(model.get_weights(), large_batch("adam")) < TOLERANCE
    assert int(optimizer.iterations) == 2 and int(optimizer.micro_steps) == 4
    # XLA reduces the gradient where it is computed, in every micro-step.
    assert _count_all_reduces(hlo) == 1


@pytest.mark.slow
def test_reductions_of_micro_steps_in_one_compiled_call(large_batch):
    """K micro-steps inside one compiled function: handing the wrapper each
    micro-batch's gradient costs one all-reduce per micro-step (the
    gradients arrive reduced, and the update's `cond` separates them).
    Summing the micro-batches' gradients inside the function (`lax.scan`)
    before the wrapper sees them lets XLA reduce once per call; the
    wrapper then accumulates over calls, still exact."""
    dist = _data_parallel()
    with dist.scope():
        model = _model()
        per_micro = _wrapped("adam")()
        per_micro.build(model.trainable_variables)
        per_call = _wrapped("adam")()
        per_call.build(model.trainable_variables)
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        # 8 micro-batches of 8, two per device.
        xs, ys = _sharded_batches(dist, X, Y, 8)

        def grad(t, x, y):
            return jax.grad(lambda t: _loss(model, t, non_trainable, x, y)[0])(
                t
            )

        def micro_steps(t, opt_values, xs, ys):
            for i in range(xs.shape[0]):
                t, opt_values = per_micro.stateless_apply(
                    opt_values, grad(t, xs[i], ys[i]), t
                )
            return t, opt_values

        def summed_call(t, opt_values, xs, ys):
            def body(total, xy):
                return jax.tree.map(jnp.add, total, grad(t, *xy)), None

            zeros = jax.tree.map(jnp.zeros_like, t)
            total, _ = jax.lax.scan(body, zeros, (xs, ys))
            mean = [g / xs.shape[0] for g in total]
            return per_call.stateless_apply(opt_values, mean, t)

        values = [v.value for v in per_micro.variables]
        lowered = jax.jit(micro_steps).lower(trainable, values, xs, ys)
        assert _count_all_reduces(lowered.compile().as_text()) == 8
        step = jax.jit(summed_call)
        values = [v.value for v in per_call.variables]
        lowered = step.lower(trainable, values, xs[:2], ys[:2])
        assert _count_all_reduces(lowered.compile().as_text()) == 1
        t = trainable
        for start in range(0, 8, 2):
            t, values = step(
                t, values, xs[start : start + 2], ys[start : start + 2]
            )
        for variable, value in zip(model.trainable_variables, t):
            variable.assign(value)
        for variable, value in zip(per_call.variables, values):
            variable.assign(value)
    # 4 calls of 2 summed micro-batches of 8, accumulation_steps=2: two
    # updates, each on 32 samples, as the large batch.
    assert _max_diff(model.get_weights(), large_batch("adam")) < TOLERANCE
    assert int(per_call.iterations) == 2


# ----------------------------------------------------------------------
# Keras limits on JAX
# ----------------------------------------------------------------------
def _train_step_hlo(model, distribution):
    """The compiled HLO of the step `fit` jits (`model.train_step`)."""
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    xs, ys = _sharded_batches(distribution, X[:MICRO], Y[:MICRO], 1)
    lowered = jax.jit(model.train_step).lower(state, (xs[0], ys[0]))
    return lowered.compile().as_text()


@pytest.mark.keras_limit
def test_fit_reduces_every_micro_step():
    """Keras's JAX `train_step` takes the gradient of the globally sharded
    batch: XLA all-reduces it there, before any optimizer sees it, so K
    micro-steps in `fit` cost K reductions (one per micro-step), with or
    without accumulation. Fails when Keras's step stops reducing there."""
    dist = _data_parallel()
    model = _fit(_wrapped("sgd"), dist, x=X[:MICRO], y=Y[:MICRO])
    with dist.scope():
        hlo = _train_step_hlo(model, dist)
    assert _count_all_reduces(hlo) == 1
    # The (combined) all-reduce of the loss and every gradient runs in the
    # step's main computation, every micro-step; the optimizer's update is
    # a `conditional` of its own.
    computation, reductions = None, []
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line
        if re.search(r"= [^\n]*all-reduce\(", line):
            reductions.append((computation, line))
    ((computation, line),) = reductions
    assert computation.startswith("ENTRY")
    assert line.count("f32[") >= 1 + len(model.trainable_variables)
    assert "conditional(" in hlo


@pytest.mark.keras_limit
def test_builtin_accumulation_counts_micro_steps_for_schedules(
    large_batch, accumulated
):
    """Keras's `gradient_accumulation_steps` evaluates the schedule on the
    micro-step counter: under DataParallel(4) it ends far from the large
    batch, where the wrapper is exact."""

    def builtin():
        return keras.optimizers.Adam(
            _schedule(), gradient_accumulation_steps=STEPS
        )

    dist = _data_parallel()
    theirs = _fit(builtin, dist).get_weights()
    ours = accumulated("adam", "data_parallel").get_weights()
    expected = large_batch("adam")
    moved = _max_diff(expected, [w for w in _model().get_weights()])
    assert _max_diff(ours, expected) < TOLERANCE
    assert _max_diff(theirs, expected) > 0.1 * moved


# ----------------------------------------------------------------------
# State: resume in the middle of a window
# ----------------------------------------------------------------------
def test_resume_mid_window_from_a_keras_file(tmp_path, large_batch):
    first = _fit(_wrapped("adam"), x=X[:48], y=Y[:48])  # 3 micro-batches
    assert int(first.optimizer.pending_steps) == 1
    path = str(tmp_path / "mid.keras")
    first.save(path)
    loaded = keras.models.load_model(path)
    optimizer = loaded.optimizer
    assert isinstance(optimizer, GradientAccumulationOptimizer)
    assert optimizer.accumulation_steps == STEPS
    assert int(optimizer.pending_steps) == 1
    assert int(optimizer.iterations) == 1
    assert (
        _max_diff(
            [a.numpy() for a in optimizer.accumulators],
            [a.numpy() for a in first.optimizer.accumulators],
        )
        == 0.0
    )
    loaded.fit(X[48:], Y[48:], batch_size=MICRO, shuffle=False, verbose=0)
    assert _max_diff(loaded.get_weights(), large_batch("adam")) < TOLERANCE


def test_resume_mid_window_from_weights_under_data_parallel(
    tmp_path, large_batch
):
    dist = _data_parallel()
    first = _fit(_wrapped("adam"), dist, x=X[:48], y=Y[:48])
    path = str(tmp_path / "mid.weights.h5")
    first.save_weights(path)
    with dist.scope():
        model = _model()
        model.compile(optimizer=_wrapped("adam")(), loss="mse")
        model.optimizer.build(model.trainable_variables)
        model.load_weights(path)
        assert int(model.optimizer.pending_steps) == 1
        model.fit(X[48:], Y[48:], batch_size=MICRO, shuffle=False, verbose=0)
    assert _max_diff(model.get_weights(), large_batch("adam")) < TOLERANCE


def test_eager_apply_and_missing_gradients():
    """`apply` outside any jit or stateless scope (a stateful custom loop):
    a variable without a gradient is left alone, with Keras's warning."""
    model = _model()
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(0.5), 2)
    before = model.get_weights()
    grads = [np.ones(v.shape, "float32") for v in model.trainable_variables]
    grads[1] = None  # hidden/bias
    for _ in range(2):
        with pytest.warns(UserWarning, match="Gradients do not exist"):
            optimizer.apply(grads, model.trainable_variables)
    after = model.get_weights()
    np.testing.assert_allclose(after[0], before[0] - 0.5, atol=1e-6)
    np.testing.assert_array_equal(after[1], before[1])
    assert int(optimizer.iterations) == 1
    assert int(optimizer.pending_steps) == 0


def test_config_round_trip():
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.AdamW(_schedule(), weight_decay=0.1), 3, name="acc"
    )
    config = optimizer.get_config()
    assert config["accumulation_steps"] == 3
    assert config["compression"] is None
    assert not config["momentum_correction"]
    again = GradientAccumulationOptimizer.from_config(config)
    assert again.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(optimizer)
    )
    assert isinstance(restored, GradientAccumulationOptimizer)
    assert isinstance(restored.inner_optimizer, keras.optimizers.AdamW)


# ----------------------------------------------------------------------
# Bad input (the same checks and messages as on TensorFlow)
# ----------------------------------------------------------------------
def test_bad_arguments():
    for steps, error, message in [
        (0, ValueError, r"integer >= 1\. Received: accumulation_steps=0"),
        (2.0, TypeError, r"Received: accumulation_steps=2\.0 \(of type float"),
        (True, TypeError, r"Received: accumulation_steps=True"),
    ]:
        with pytest.raises(error, match=message):
            GradientAccumulationOptimizer(keras.optimizers.SGD(), steps)
    for argument in ("clipnorm", "global_clipnorm", "learning_rate", "use_ema"):
        with pytest.raises(ValueError, match=f"Set `{argument}` on the"):
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(), 2, **{argument: 1.0}
            )
    with pytest.raises(TypeError, match=r"Received: inner_optimizer='sgd'"):
        GradientAccumulationOptimizer("sgd", 2)
    inner = keras.optimizers.SGD(gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="own gradient_accumulation_steps=4"):
        GradientAccumulationOptimizer(inner, 2)
    once = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match="already a GradientAccumulation"):
        GradientAccumulationOptimizer(once, 2)
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="Put loss scaling outside"):
        GradientAccumulationOptimizer(scaled, 2)


def test_compression_refuses_on_jax():
    with pytest.raises(BackendNotSupportedError, match="'jax' backend") as e:
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(), 2, compression="float16"
        )
    assert "without compression" in str(e.value)
    with pytest.raises(ValueError, match="needs an SGD inner optimizer"):
        GradientAccumulationOptimizer(
            keras.optimizers.Adam(), 2, momentum_correction=True
        )


# ----------------------------------------------------------------------
# Momentum correction (Goyal et al.) against its closed form
# ----------------------------------------------------------------------
def test_momentum_correction_matches_rate_free_momentum():
    """`u = m*u + g; w -= lr_t*u` (float64) on a linear model, the rate
    changing at most updates, under DataParallel(4) with accumulation."""
    momentum, updates, micro = 0.9, 5, 16
    rates = keras.optimizers.schedules.PiecewiseConstantDecay(
        [0, 1, 3], [0.01, 0.05, 0.1, 0.03]
    )
    rng = np.random.default_rng(5)
    x = rng.normal(size=(updates * STEPS * micro, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.3).astype("float32")
    with _data_parallel().scope():
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(1, kernel_initializer="zeros"),
            ]
        )
        optimizer = GradientAccumulationOptimizer(
            keras.optimizers.SGD(rates, momentum=momentum),
            STEPS,
            momentum_correction=True,
        )
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=micro, shuffle=False, verbose=0)
    w, b = np.zeros((5, 1)), np.zeros((1,))
    u_w, u_b = np.zeros_like(w), np.zeros_like(b)
    large = STEPS * micro
    for t in range(updates):
        xb = x[t * large : (t + 1) * large].astype("float64")
        error = xb @ w + b - y[t * large : (t + 1) * large]
        u_w = momentum * u_w + 2.0 * xb.T @ error / large
        u_b = momentum * u_b + 2.0 * error.sum(axis=0) / large
        lr = float(rates(t))
        w, b = w - lr * u_w, b - lr * u_b
    weights = np.concatenate([v.ravel() for v in model.get_weights()])
    np.testing.assert_allclose(
        weights, np.concatenate([w.ravel(), b]), rtol=2e-5, atol=2e-6
    )
    assert int(optimizer.iterations) == updates
    assert float(optimizer.previous_learning_rate) == pytest.approx(
        float(rates(updates - 1))
    )
