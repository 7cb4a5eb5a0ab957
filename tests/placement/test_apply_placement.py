"""apply_placement / strip_placement: equivalence with the unplaced model,
where the variables really are, policies, bad input, strategies."""

from __future__ import annotations

import numpy as np
import pytest
from _placement_helpers import (
    CPUS,
    FEATURES,
    assert_grads_close,
    canonical,
    data,
    device_of,
    loss_and_grads,
    stage_cuts,
    staged_mlp,
)

from keras_mgpu import _flavour
from keras_mgpu.layers import RecomputeGrad, apply_recompute
from keras_mgpu.placement import (
    PlacedLayer,
    PlacedModel,
    apply_placement,
    strip_placement,
)

keras = _flavour.keras
tf = _flavour.tf


def _placed_layers(model):
    return [layer for layer in model.layers if isinstance(layer, PlacedLayer)]


def _assert_on_stage_devices(placed, devices):
    """Each `s<k>_...` layer's variables live on devices[k] (read from
    TensorFlow), and every device holds a stage."""
    used = set()
    for layer in _placed_layers(placed):
        stage = int(layer.name[1 : layer.name.index("_")])
        expected = f"/device:CPU:{devices[stage][-1]}"
        assert layer.device == expected
        for variable in layer.layer.variables:
            assert device_of(variable) == expected, variable.path
            used.add(device_of(variable))
    assert len(used) == len(devices)


@pytest.mark.parametrize("stages", [2, 4])
def test_outputs_and_gradients_equal_the_unplaced_model_with_dropout(stages):
    model = staged_mlp(stages, dropout=0.3)
    devices = CPUS[:stages]
    placed = apply_placement(model, devices, policy=stage_cuts(model))
    assert isinstance(placed, PlacedModel)
    _assert_on_stage_devices(placed, devices)
    x, y = data()
    np.testing.assert_allclose(placed(x), model(x), rtol=1e-6, atol=1e-6)
    # Same seeds: the dropout masks match draw for draw.
    for _ in range(2):
        loss, grads = loss_and_grads(placed, tf.constant(x), y)
        expected_loss, expected = loss_and_grads(model, tf.constant(x), y)
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        assert_grads_close(grads, expected)


def _block(name, seed):
    return keras.Sequential(
        [
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.25, seed=seed),
            keras.layers.Dense(12),
        ],
        name=name,
    )


def test_recompute_grad_stages_equal_the_plain_model():
    """GPipe's re-materialisation: each stage one RecomputeGrad block,
    recomputed on its device; gradients equal the plain model's (no
    recompute, no placement), dropout included."""
    keras.utils.set_random_seed(4)
    plain = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            _block("s0_block", 1),
            _block("s1_block", 2),
            keras.layers.Dense(3, name="s1_out"),
        ]
    )
    remat = apply_recompute(
        plain, layers=["s0_block", "s1_block"], in_place=False
    )
    placed = apply_placement(remat, CPUS[2:4], policy=["recompute_s1_block"])
    stages = _placed_layers(placed)
    assert [type(layer.layer) for layer in stages[:2]] == [RecomputeGrad] * 2
    assert [layer.device for layer in stages] == [
        "/device:CPU:2",
        "/device:CPU:3",
        "/device:CPU:3",
    ]
    for layer in stages:
        assert {device_of(v) for v in layer.layer.variables} == {layer.device}
    x, y = data()
    for _ in range(2):
        loss, grads = loss_and_grads(placed, tf.constant(x), y)
        expected_loss, expected = loss_and_grads(plain, tf.constant(x), y)
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        assert_grads_close(grads, expected)


def _branching_model():
    """Two inputs, a residual `x + y` (a bare operation), a concatenation
    and two outputs."""
    keras.utils.set_random_seed(8)
    a = keras.Input((FEATURES,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Dense(FEATURES, activation="tanh", name="h1")(a)
    h = keras.layers.Dense(FEATURES, name="h2")(h) + a
    g = keras.layers.Dense(6, activation="relu", name="g")(b)
    z = keras.layers.Concatenate(name="cat")([h, g])
    out1 = keras.layers.Dense(2, name="head_1")(z)
    out2 = keras.layers.Dense(1, name="head_2")(
        keras.layers.Dense(5, name="pre_2")(z)
    )
    return keras.Model({"a": a, "b": b}, [out1, out2], name="branching")


def test_a_branching_functional_model_with_operations():
    model = _branching_model()
    placed = apply_placement(model, CPUS[:3])
    assert placed.output_names == model.output_names
    # `layers` lists layers only; the config lists every graph node.
    classes = [entry["class_name"] for entry in placed.get_config()["layers"]]
    assert "PlacedOperation" in classes, classes
    rng = np.random.default_rng(1)
    inputs = {
        "a": rng.normal(size=(10, FEATURES)).astype("float32"),
        "b": rng.normal(size=(10, 4)).astype("float32"),
    }
    for got, want in zip(placed(inputs), model(inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    def grads(m):
        with tf.GradientTape() as tape:
            o1, o2 = m(inputs)
            loss = tf.reduce_sum(o1**2) + tf.reduce_sum(o2)
        return tape.gradient(loss, m.trainable_variables)

    assert_grads_close(grads(placed), grads(model))
    plain = strip_placement(placed)
    assert plain.output_names == model.output_names
    for got, want in zip(plain(inputs), model(inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_strip_placement_gives_back_the_plain_model():
    model = staged_mlp(2, dropout=0.2)
    placed = apply_placement(model, CPUS[1:3])
    plain = strip_placement(placed)
    assert not _placed_layers(plain) and not isinstance(plain, PlacedModel)
    assert [layer.name for layer in plain.layers[1:]] == [
        layer.name for layer in model.layers
    ]
    for a, b in zip(plain.variables, model.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    default = canonical(tf.Variable(0.0).device)
    assert {device_of(v) for v in plain.weights} == {default}


def test_mapping_and_cut_point_policies():
    model = staged_mlp(3)
    by_name = apply_placement(
        model, policy={"s1_a": "/cpu:2", "s2_a": "cpu:3", "s0_a": "/cpu:1"}
    )
    by_cut = apply_placement(model, CPUS[1:4], policy=[2, "s2_a"])
    for placed in (by_name, by_cut):
        assert [layer.device[-1] for layer in _placed_layers(placed)] == list(
            "1122333"
        )
    by_class = apply_placement(model, policy={keras.layers.Dense: "/cpu:2"})
    assert {layer.device for layer in _placed_layers(by_class)} == {
        "/device:CPU:2"
    }


def test_default_devices_are_the_logical_cpus_here():
    model = staged_mlp(4)
    placed = apply_placement(model)  # no GPU: the 4 logical CPU devices
    assert {layer.device for layer in _placed_layers(placed)} == {
        f"/device:CPU:{i}" for i in range(4)
    }


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(devices=["/cpu:9"]),
            ValueError,
            r"names devices that this process does not have: \['/cpu:9'\]",
        ),
        (
            dict(devices=["/cpu:0", "cpu:0"]),
            ValueError,
            "names a device more than once",
        ),
        (dict(devices=[]), ValueError, "must name at least one device"),
        (
            dict(devices="/cpu:0"),
            TypeError,
            "must be None or a list of device names",
        ),
        (
            dict(devices=["gpu"]),
            ValueError,
            "must name one device, with its type and index",
        ),
        (
            dict(
                devices=CPUS,
                policy="balanced",
                micro_batches=None,
                model="tiny",
            ),
            ValueError,
            r"asks for 4 stages, but model 'tiny' has only 3 layers",
        ),
        (
            dict(policy={"nope": "/cpu:0"}),
            ValueError,
            "maps layer 'nope' to a device, but no layer of the model "
            "matches it",
        ),
        (
            dict(policy={keras.layers.Conv2D: "/cpu:0"}),
            ValueError,
            "maps layer of class 'Conv2D' to a device, but no layer",
        ),
        (
            dict(policy={"s0_a": "/cpu:7"}),
            ValueError,
            "`policy` names devices that this process does not have",
        ),
        (
            dict(devices=CPUS[:2], policy={"s0_a": "/cpu:3"}),
            ValueError,
            r"maps 's0_a' to /device:CPU:3, which is not one of argument "
            r"`devices`",
        ),
        (dict(policy={}), ValueError, "must map at least one layer"),
        (
            dict(policy={3: "/cpu:0"}),
            TypeError,
            "layer names or Keras layer classes as keys",
        ),
        (
            dict(devices=CPUS[:2], policy=[9]),
            ValueError,
            "strictly increasing layer positions from 1 to",
        ),
        (dict(devices=CPUS[:2], policy=[0]), ValueError, "strictly increasing"),
        (
            dict(devices=CPUS[:3], policy=[3, 2]),
            ValueError,
            "strictly increasing",
        ),
        (
            dict(devices=CPUS[:2], policy=[1, 2]),
            ValueError,
            "needs one cut per boundary between stages: 1 for 2 devices",
        ),
        (
            dict(devices=CPUS[:2], policy=["nope"]),
            ValueError,
            "names a cut at layer 'nope'",
        ),
        (
            dict(devices=CPUS[:2], policy=[1.5]),
            TypeError,
            "must hold layer indices or names",
        ),
        (dict(policy="fast"), ValueError, "must be 'balanced', a mapping"),
        (
            dict(policy=3),
            TypeError,
            r"must be 'balanced', a mapping .* Received: policy=3 "
            r"\(of type int\)",
        ),
        (
            dict(micro_batches=0),
            ValueError,
            r"Argument `micro_batches` must be an integer >= 1 or None. "
            r"Received: micro_batches=0",
        ),
        (
            dict(micro_batches=2.0),
            TypeError,
            "Argument `micro_batches` must be an integer >= 1 or None",
        ),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = dict(kwargs)
    if kwargs.pop("model", None) == "tiny":
        model = keras.Sequential(
            [keras.Input((2,)), *(keras.layers.Dense(2) for _ in range(3))],
            name="tiny",
        )
    else:
        model = staged_mlp(2)
    kwargs.setdefault("devices", None)
    with pytest.raises(error, match=match):
        apply_placement(model, **kwargs)


def test_bad_models():
    with pytest.raises(
        TypeError,
        match="expects a Sequential or functional keras.Model as argument "
        "`model`",
    ):
        apply_placement(keras.layers.Dense(2))
    subclassed = _Subclassed()
    subclassed(np.zeros((1, 3), "float32"))
    with pytest.raises(
        ValueError,
        match="cannot place a subclassed model: its layers are wired in "
        "Python code",
    ):
        apply_placement(subclassed)
    unbuilt = keras.Sequential([keras.layers.Dense(2)], name="unbuilt")
    with pytest.raises(
        ValueError,
        match=r"needs a built model with known inputs.*model='unbuilt'",
    ):
        apply_placement(unbuilt)
    placed = apply_placement(staged_mlp(2), CPUS[:2])
    with pytest.raises(
        ValueError, match="is already placed; call `keras_mgpu.strip_placement"
    ):
        apply_placement(placed)
    with pytest.raises(ValueError, match="has no placed layers"):
        strip_placement(staged_mlp(2))


def test_sparse_inputs_cannot_be_cut_into_micro_batches():
    inputs = keras.Input((6,), sparse=True, name="bag")
    outputs = keras.layers.Dense(2)(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, outputs)
    with pytest.raises(
        ValueError,
        match="`micro_batches` needs dense inputs: model input 'bag' is "
        "sparse or ragged",
    ):
        apply_placement(model, CPUS[:2], micro_batches=2)


def test_a_device_this_process_lacks_warns_and_lets_tensorflow_place():
    inputs = keras.Input((3,))
    hidden = PlacedLayer(keras.layers.Dense(4, name="far"), "/gpu:7")
    with pytest.warns(UserWarning, match="placed on /device:GPU:7, which this"):
        outputs = hidden(inputs)
    model = PlacedModel(inputs, outputs)
    assert model.predict(np.ones((2, 3), "float32"), verbose=0).shape == (2, 4)
    assert hidden.get_config()["device"] == "/device:GPU:7"
