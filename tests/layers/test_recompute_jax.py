"""Recompute on Keras's JAX backend: `apply_recompute` (every policy, in
place and rebuilt), `RecomputeGrad`, `strip_recompute`, `recomputed_layers`,
built on `jax.checkpoint`.

Every equivalence is checked against the same model called plainly (same
variable values, seed states included): gradients, new non-trainable values
(seed states, BatchNormalization statistics) and added losses, Dropout inside
the recomputed regions. Memory: what the backward pass keeps, read from the
program JAX builds (saved residuals, and the peak of values alive at once).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu.backend.jax import recompute_memory
from keras_mgpu.layers import RecomputeGrad

BATCH, FEATURES, WIDTH = 16, 8, 16


def _stack(depth: int = 6, dropout: float = 0.3, extras: bool = True):
    """A functional chain of Dense-ReLU layers; Dropout after every other
    one; with `extras`, a BatchNormalization and an activity regularizer
    inside the chain."""
    inputs = keras.Input((FEATURES,))
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(
            WIDTH,
            activation="relu",
            name=f"dense_{i}",
            activity_regularizer=("l2" if extras and i == 2 else None),
        )(x)
        if dropout and i % 2 == 1:
            x = keras.layers.Dropout(dropout, name=f"dropout_{i}")(x)
        if extras and i == 3:
            x = keras.layers.BatchNormalization(name="norm")(x)
    outputs = keras.layers.Dense(1, name="head")(x)
    return keras.Model(inputs, outputs, name="stack")


def _data(batch: int = BATCH, features: int = FEATURES):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, features)).astype("float32")
    y = rng.normal(size=(batch, 1)).astype("float32")
    return x, y


def _loss_fn(model, x, y):
    def loss(trainable, non_trainable):
        out, new_non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True
        )
        main = keras.ops.mean(keras.ops.square(out - y))
        extra = sum(losses) if losses else 0.0
        return main + extra, (new_non_trainable, main)

    return loss


def _values(model):
    return (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )


def _step(model, x, y, jit=False):
    """(loss, gradients, new non-trainable values) of one stateless step,
    `jax.grad` of `model.stateless_call` (op by op: faster than compiling
    for these small models)."""
    grad = jax.value_and_grad(_loss_fn(model, x, y), has_aux=True)
    if jit:
        grad = jax.jit(grad)
    (loss, (new_values, _)), grads = grad(*_values(model))
    return float(loss), grads, new_values


def _regions(model, x, y) -> int:
    """How many checkpointed regions the step's program runs."""
    return recompute_memory.checkpoint_count(
        _loss_fn(model, x, y), *_values(model)
    )


def _assert_same_step(expected, got, atol=1e-6):
    loss0, grads0, new0 = expected
    loss1, grads1, new1 = got
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert len(grads0) == len(grads1)
    for a, b in zip(grads0, grads1, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=atol)
    for a, b in zip(new0, new1, strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=atol)


# ---------------------------------------------------------------------------
# Gradients: a custom stateless loop (`jax.grad` of `stateless_call`).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, regions",
    # 11 layers: 6 Dense, 3 Dropout, the norm, the head. sqrt: segments of
    # ceil(sqrt(11)) = 4 layers; min_memory: 4, 3, 2, 2.
    [("per_layer", 11), ("sqrt", 3), ("min_memory", 4)],
)
def test_in_place_gradients_equal_plain(policy, regions):
    model = _stack()
    x, y = _data()
    plain = _step(model, x, y)
    assert _regions(model, x, y) == 0
    # Dropout is live: another seed state gives another loss.
    assert keras_mgpu.apply_recompute(model, policy=policy) is model
    assert _regions(model, x, y) == regions
    _assert_same_step(plain, _step(model, x, y))
    # Seed states and moving statistics advanced once, as plainly.
    names = [v.path for v in model.non_trainable_variables]
    assert any("seed_generator" in n for n in names)
    assert any("moving_mean" in n for n in names)


def test_dropout_masks_are_replayed_not_redrawn():
    """Break-check: without the seed states as inputs of the checkpointed
    function, the recomputation would draw another mask; with them the
    gradient equals plain's, and differs from a step at another seed
    state (so the comparison would see a redraw)."""
    model = _stack(extras=False)
    x, y = _data()
    plain = _step(model, x, y)
    keras_mgpu.apply_recompute(model, policy="sqrt")
    _assert_same_step(plain, _step(model, x, y))
    for v in model.non_trainable_variables:
        v.assign(v.value + 1)  # other seed states: other masks
    moved = _step(model, x, y)
    assert not np.allclose(moved[0], plain[0])


def test_mixed_precision_gradients_equal_plain():
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = _stack(depth=4)
    finally:
        keras.config.set_dtype_policy("float32")
    x, y = _data()
    plain = _step(model, x, y)
    keras_mgpu.apply_recompute(model, policy="sqrt")
    assert _regions(model, x, y) > 0
    _assert_same_step(plain, _step(model, x, y))


def test_group_by_and_rebuild_give_plain_gradients():
    model = _stack(extras=False)
    x, y = _data()
    plain = _step(model, x, y)
    keras_mgpu.apply_recompute(
        model, group_by=lambda layer: layer.name.split("_")[-1]
    )
    assert _regions(model, x, y) > 0
    _assert_same_step(plain, _step(model, x, y))
    keras_mgpu.strip_recompute(model)
    rebuilt = keras_mgpu.apply_recompute(model, policy="sqrt", in_place=False)
    assert rebuilt is not model
    # A rebuild draws new seed states (as TFMOT's does); give it ours.
    for a, b in zip(model.variables, rebuilt.variables, strict=True):
        assert a.path.split("/")[-1] == b.path.split("/")[-1]
        b.assign(a.value)
    assert any(isinstance(layer, RecomputeGrad) for layer in rebuilt.layers)
    _assert_same_step(plain, _step(rebuilt, x, y))


def test_recompute_grad_wrapper_gives_plain_gradients():
    def block():
        return keras.Sequential(
            [
                keras.layers.Dense(WIDTH, activation="relu"),
                keras.layers.Dropout(0.5),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(WIDTH),
            ],
            name="block",
        )

    def model_of(inner):
        inputs = keras.Input((FEATURES,))
        outputs = keras.layers.Dense(1)(inner(inputs))
        return keras.Model(inputs, outputs)

    plain_model = model_of(block())
    wrapped = model_of(RecomputeGrad(block()))
    for a, b in zip(plain_model.variables, wrapped.variables, strict=True):
        b.assign(a.value)
    x, y = _data()
    assert _regions(wrapped, x, y) == 1
    _assert_same_step(_step(plain_model, x, y), _step(wrapped, x, y))
    assert keras_mgpu.recomputed_layers(wrapped)[0].name == "block"


def test_strip_recompute_gives_back_the_plain_call():
    model = _stack()
    x, y = _data()
    plain = _step(model, x, y)
    keras_mgpu.apply_recompute(model, policy="sqrt")
    assert len(keras_mgpu.recomputed_layers(model)) == 11
    assert keras_mgpu.strip_recompute(model) is model
    assert keras_mgpu.recomputed_layers(model) == []
    assert _regions(model, x, y) == 0
    assert all("call" not in layer.__dict__ for layer in model.layers)
    _assert_same_step(plain, _step(model, x, y))


def test_eager_call_and_symbolic_build_run_plainly():
    model = _stack()
    x, _ = _data()
    expected = np.asarray(model(x, training=False))
    keras_mgpu.apply_recompute(model, policy="per_layer")
    np.testing.assert_allclose(np.asarray(model(x, training=False)), expected)
    # A functional model built on a recomputed layer (symbolic call).
    outer = keras.Model(model.inputs, model(model.inputs[0]) * 2.0)
    np.testing.assert_allclose(
        np.asarray(outer(x, training=False)), 2 * expected, rtol=1e-6
    )


# ---------------------------------------------------------------------------
# fit, and fit under keras.distribution.DataParallel.
# ---------------------------------------------------------------------------


def _fit_weights(model, x, y, epochs=1):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return [np.asarray(v.value) for v in model.variables]


def _twins(build):
    plain, ours = build(), build()
    for a, b in zip(plain.variables, ours.variables, strict=True):
        # A copy: fit donates the state's buffers to its jitted step.
        b.assign(np.array(a.value))
    return plain, ours


def test_fit_weights_equal_plain():
    x, y = _data(batch=48)
    plain, ours = _twins(_stack)
    keras_mgpu.apply_recompute(ours, policy="sqrt")
    for a, b in zip(
        _fit_weights(plain, x, y), _fit_weights(ours, x, y), strict=True
    ):
        np.testing.assert_allclose(b, a, atol=1e-6)


def _distribution(kind: str):
    devices = keras.distribution.list_devices("cpu")
    assert len(devices) == 4
    if kind == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], devices=devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense_.*kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


@pytest.mark.parametrize("kind", ["data_parallel", "model_parallel"])
def test_fit_under_a_distribution_equals_plain(kind):
    distribution = _distribution(kind)
    x, y = _data(batch=32)
    with distribution.scope():
        plain, ours = _twins(lambda: _stack(extras=False))
        keras_mgpu.apply_recompute(ours, policy="min_memory")
        weights0 = _fit_weights(plain, x, y)
        weights1 = _fit_weights(ours, x, y)
    for a, b in zip(weights0, weights1, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)
    if kind == "model_parallel":
        spec = ours.get_layer("dense_0").kernel.value.sharding.spec
        assert tuple(spec) == (None, "model")


# ---------------------------------------------------------------------------
# Offload: what a recomputed unit keeps lives in host memory.
# ---------------------------------------------------------------------------


def _offload_block():
    """Dense-GELU, LayerNormalization, Dropout and a Dense with a layer
    activation: every part `"selective"` switches, with a live dropout."""
    inputs = keras.Input((FEATURES,))
    x = inputs
    for i in range(3):
        x = keras.layers.Dense(WIDTH, activation="gelu", name=f"dense_{i}")(x)
        x = keras.layers.LayerNormalization(name=f"norm_{i}")(x)
        x = keras.layers.Dropout(0.3, name=f"dropout_{i}")(x)
    x = keras.layers.Dense(
        WIDTH, activation=keras.layers.LeakyReLU(0.2), name="leaky"
    )(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def _host_bytes(model, x, y) -> int:
    return recompute_memory.model_residual_bytes(model, x, y, memory="host")


@pytest.mark.parametrize("policy", ["per_layer", "sqrt", "selective"])
def test_offload_gradients_equal_plain_and_keep_activations_on_the_host(
    policy,
):
    model = _offload_block()
    x, y = _data(batch=32)
    plain = _step(model, x, y)
    keras_mgpu.apply_recompute(model, policy=policy)
    on_device = recompute_memory.model_residual_bytes(
        model, x, y, memory="device"
    )
    peak = recompute_memory.model_backward_peak_bytes(model, x, y)
    assert _host_bytes(model, x, y) == 0
    keras_mgpu.strip_recompute(model)
    keras_mgpu.apply_recompute(model, policy=policy, offload=True)
    # GELU and the norms round differently once regions split the program.
    _assert_same_step(plain, _step(model, x, y), atol=1e-5)
    host = _host_bytes(model, x, y)
    left = recompute_memory.model_residual_bytes(model, x, y, memory="device")
    activation = 32 * WIDTH * 4
    if policy == "selective":
        # The recomputed parts' inputs went to the host: the 3 Dense-GELU
        # products, the 3 norms' inputs and the product LeakyReLU (a
        # sublayer of "leaky") reads; the rest, kept as plainly (the
        # Dense layers' inputs), stays on the device.
        assert host == 7 * activation
        assert left < on_device
    else:
        # What the units kept on the device went to the host (the input
        # x, an argument before, is now copied there too); what stays is
        # small (seed states and the like).
        assert host >= on_device - activation
        assert left < activation
    # The device's peak: lower where the kept activations made it; with
    # sqrt's two segments the replay of one segment makes it.
    offloaded_peak = recompute_memory.model_backward_peak_bytes(model, x, y)
    if policy == "sqrt":
        assert offloaded_peak <= peak
    else:
        assert offloaded_peak < peak
    keras_mgpu.strip_recompute(model)
    assert _host_bytes(model, x, y) == 0


@pytest.mark.parametrize("kind", ["data_parallel", "model_parallel"])
def test_offload_in_fit_under_a_distribution_equals_plain(kind):
    distribution = _distribution(kind)
    x, y = _data(batch=32)
    with distribution.scope():
        plain, ours = _twins(_offload_block)
        config = ours.get_config()
        keras_mgpu.apply_recompute(ours, offload=True)
        weights0 = _fit_weights(plain, x, y)
        weights1 = _fit_weights(ours, x, y)
        # The step `fit` jits moves to the host, for one batch of 16, the
        # input of each unit whose backward needs it: dense_0's (x,
        # FEATURES wide), the 3 norms', dense_1's, dense_2's, leaky's and
        # the head's (WIDTH wide). A Dropout's backward needs only its
        # mask: its input stays where it is.
        moved = recompute_memory.train_step_offloaded_bytes(
            ours, x[:16], y[:16]
        )
        assert moved == 16 * 4 * (FEATURES + 3 * WIDTH + 4 * WIDTH)
        assert (
            recompute_memory.train_step_offloaded_bytes(plain, x[:16], y[:16])
            == 0
        )
    for a, b in zip(weights0, weights1, strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)
    # Nothing of the switch is saved.
    assert ours.get_config() == config


# ---------------------------------------------------------------------------
# keras-hub: a backbone recomputed in place keeps its class.
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_keras_hub_backbone_in_place_keeps_class_and_gradients():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=0.2,
        max_sequence_length=8,
    )
    rng = np.random.default_rng(0)
    inputs = {
        "token_ids": rng.integers(0, 50, size=(4, 8)).astype("int32"),
        "padding_mask": np.array([[1] * 8, [1] * 6 + [0] * 2] * 2, "int32"),
    }
    target = rng.normal(size=(4, 8, 16)).astype("float32")
    plain = _step(backbone, inputs, target)
    # Both decoder layers in one segment, the padding mask a side input.
    decoder = keras_hub.layers.TransformerDecoder
    keras_mgpu.apply_recompute(backbone, decoder, policy="sqrt")
    assert type(backbone) is keras_hub.models.GPT2Backbone
    assert len(keras_mgpu.recomputed_layers(backbone)) == 2
    assert _regions(backbone, inputs, target) == 1
    _assert_same_step(plain, _step(backbone, inputs, target))
    assert keras_mgpu.strip_recompute(backbone) is backbone


# ---------------------------------------------------------------------------
# Memory: what the backward pass keeps.
# ---------------------------------------------------------------------------


def _deep(depth: int = 16, width: int = 32):
    inputs = keras.Input((width,))
    x = inputs
    for i in range(depth):
        x = keras.layers.Dense(width, activation="relu", name=f"relu_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def test_memory_kept_is_the_policy_count_and_below_plain():
    width, batch = 32, 256
    x, y = _data(batch=batch, features=width)
    activation = batch * width * 4  # one float32 activation
    head = batch * 4  # the head's output, kept for the loss

    def measure(model):
        return (
            recompute_memory.model_residual_bytes(model, x, y),
            recompute_memory.model_backward_peak_bytes(model, x, y),
        )

    model = _deep()
    plain_kept, plain_peak = measure(model)
    # Plainly, every ReLU layer keeps at least its output.
    assert plain_kept >= 16 * activation
    results = {}
    # Policy counts, 17 units (16 ReLU layers and the head): per layer,
    # each layer's input (the model's input excepted: an argument); sqrt,
    # segments of 5 -> 3 inner boundaries; min_memory, 6+5+4+2 -> 3.
    for policy, boundaries in (
        ("per_layer", 16),
        ("sqrt", 3),
        ("min_memory", 3),
    ):
        keras_mgpu.strip_recompute(model)
        keras_mgpu.apply_recompute(model, policy=policy)
        kept, peak = measure(model)
        assert kept <= boundaries * activation + head, policy
        assert peak < plain_peak, policy
        results[policy] = (kept, peak)
    assert results["sqrt"][0] < 0.1 * plain_kept
    assert results["sqrt"][1] < 0.6 * plain_peak
    assert results["min_memory"][1] <= results["sqrt"][1]
    # keras.RematScope, every layer (model included) rematerialized: its
    # peak is a per-layer one, above ours.
    with keras.RematScope(mode="full"):
        scoped = _deep()
    _, scoped_peak = measure(scoped)
    assert results["sqrt"][1] < scoped_peak


def test_peak_reading_sees_a_plain_recomputation():
    """Break-check of the reading: checkpointing the whole function keeps
    nothing between the passes but brings no lower peak."""

    def chain(w, x):
        for _ in range(8):
            x = jax.numpy.tanh(x @ w)
        return (x**2).sum()

    w = np.eye(64, dtype="float32")
    x = np.ones((128, 64), "float32")
    plain = recompute_memory.backward_peak_bytes(chain, w, x)
    whole = jax.checkpoint(chain)
    assert recompute_memory.residual_bytes(whole, w, x) == 0
    assert recompute_memory.backward_peak_bytes(whole, w, x) >= plain


# ---------------------------------------------------------------------------
# Keras's own RematScope (a Keras limit) and bad arguments.
# ---------------------------------------------------------------------------


@pytest.mark.keras_limit
def test_keras_remat_scope_fails_with_dropout_where_ours_works():
    """Keras 3.15.1 on JAX: a model built under `keras.RematScope(mode=
    "full")` with a Dropout cannot be differentiated: `jax.checkpoint`
    around each layer's `call` turns its `training` argument into a tracer,
    and Dropout's `if training:` fails (JAX's error then fails to format:
    AttributeError); `fit` refuses to build the model. Ours gives plain
    gradients. Fails when Keras fixes it."""
    x, y = _data()
    with keras.RematScope(mode="full"):
        scoped = _stack(extras=False)
    with pytest.raises((AttributeError, jax.errors.JAXTypeError)):
        _step(scoped, x, y)
    model = _stack(extras=False)
    plain = _step(model, x, y)
    keras_mgpu.apply_recompute(model, policy="per_layer")
    _assert_same_step(plain, _step(model, x, y))


def test_bad_arguments_raise_as_on_tensorflow():
    model = _stack(depth=2, extras=False)
    apply = keras_mgpu.apply_recompute
    cases = [
        (lambda: apply(model, policy="tiny"), ValueError, "policy"),
        (lambda: apply(model, in_place="yes"), TypeError, "in_place='yes'"),
        (lambda: apply(model, ["nope"]), ValueError, "not have: \\['nope'\\]"),
        (lambda: apply(model, layers=3), TypeError, "layers=3"),
        (lambda: apply(model, group_by=3), TypeError, "group_by=3"),
        (
            lambda: apply(model, policy="min_memory", in_place=False),
            ValueError,
            "in_place=True",
        ),
        (lambda: apply(object()), TypeError, "keras.Model"),
        (lambda: keras_mgpu.strip_recompute("m"), TypeError, "keras.Model"),
        (lambda: apply(model, offload="yes"), TypeError, "offload='yes'"),
        (
            lambda: apply(model, offload=True, in_place=False),
            ValueError,
            "offload=True.*in_place=True",
        ),
        (lambda: RecomputeGrad("dense"), TypeError, "layer='dense'"),
        (
            lambda: RecomputeGrad(RecomputeGrad(keras.layers.Dense(2))),
            ValueError,
            "already wrapped",
        ),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    apply(model, "dense_0")
    with pytest.raises(ValueError, match="already recomputed in place"):
        RecomputeGrad(model.get_layer("dense_0"))
