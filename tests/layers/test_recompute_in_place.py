"""apply_recompute(..., in_place=True): layers anywhere in the tree switched
to recompute, the model itself unchanged; strip_recompute switches back.

Reference: the plain model built from the same seed (same weights, same
dropout seed states). Forward outputs and gradients are compared bit for
bit: the recomputation runs the same ops on the same seeds.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest
from _recompute_helpers import distributed_gradients

from keras_mgpu import _flavour
from keras_mgpu.layers import (
    RecomputeGrad,
    apply_recompute,
    recomputed_layers,
    strip_recompute,
)
from keras_mgpu.layers.recompute_in_place import segment_plan

keras = _flavour.keras
tf = _flavour.tf

X = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")


@keras.saving.register_keras_serializable(package="test_in_place")
class Counting(keras.layers.Layer):
    """Identity that counts its executions (traces, under tf.function)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, inputs):
        self.calls += 1
        return inputs


def make_block(name: str, stochastic: bool = True) -> keras.Sequential:
    layers = [keras.layers.Dense(8, activation="relu"), Counting()]
    if stochastic:  # seed drawn from the global seed at construction
        layers.append(keras.layers.Dropout(0.3))
    layers += [keras.layers.LayerNormalization(), keras.layers.Dense(6)]
    return keras.Sequential(layers, name=name)


def user_model(stochastic: bool = True, seed: int = 11) -> keras.Model:
    """A user model around a nested functional "encoder" of 3 blocks."""
    keras.utils.set_random_seed(seed)
    encoder_inputs = keras.Input((6,))
    h = encoder_inputs
    for i in range(3):
        h = make_block(f"block_{i}", stochastic)(h)
    encoder = keras.Model(encoder_inputs, h, name="encoder")
    inputs = keras.Input((6,), name="x")
    h = encoder(inputs)
    rate = 0.2 if stochastic else 0.0
    h = keras.layers.Dropout(rate, name="top_drop")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    return keras.Model(inputs, outputs, name="user_model")


class Tower(keras.Model):
    """Subclassed: blocks held in a list attribute, wired in `call`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [make_block(f"tower_block_{i}") for i in range(2)]
        self.head = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        for block in self.blocks:
            inputs = block(inputs, training=training)
        return self.head(inputs)


def tower(seed: int = 5) -> Tower:
    keras.utils.set_random_seed(seed)
    model = Tower(name="tower")
    model(X)
    return model


def step(model, inputs=X, compiled: bool = False) -> list:
    """Output, gradients and non-trainable state after one training step."""

    def run(inputs):
        with tf.GradientTape() as tape:
            outputs = model(inputs, training=True)
            loss = tf.reduce_sum(tf.square(outputs))
        return outputs, tape.gradient(loss, model.trainable_variables)

    if compiled:
        run = tf.function(run)
    outputs, grads = run(inputs)
    return [
        np.asarray(outputs),
        *[np.asarray(tf.convert_to_tensor(g)) for g in grads],
        *[np.asarray(v.numpy()) for v in model.non_trainable_variables],
    ]


def assert_identical(actual: list, expected: list) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(a, e)


def counters(model) -> list:
    return [
        layer.calls
        for layer in model._flatten_layers()
        if isinstance(layer, Counting)
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
def test_nested_layers_bit_identical_to_plain_model(compiled):
    plain, model = user_model(), user_model()
    config = model.get_config()
    same = apply_recompute(model, keras.Sequential, in_place=True)
    assert same is model and type(model).__name__ == "Functional"
    assert [layer.name for layer in recomputed_layers(model)] == [
        "block_0",
        "block_1",
        "block_2",
    ]
    assert model.get_config() == config  # nothing of the switch is saved
    # Two steps: dropout seed states advance alike in both models.
    for _ in range(2):
        expected, actual = step(plain, compiled=compiled), None
        for layer in model._flatten_layers():
            if isinstance(layer, Counting):
                layer.calls = 0
        actual = step(model, compiled=compiled)
        assert_identical(actual, expected)
        assert counters(model) == [2, 2, 2]  # forward + recomputation
    strip_recompute(model)
    assert recomputed_layers(model) == []
    assert "call" not in model.get_layer("encoder").layers[1].__dict__
    assert_identical(step(model), step(plain))


def test_control_rebuild_redraws_dropout_seeds():
    """Control: the bit-identity above can fail. The rebuild clones layers
    from their config, which draws new dropout seeds (as clone_model does),
    so its first step differs from the plain model's."""
    plain = user_model()
    rebuilt = apply_recompute(
        user_model(), ["top_drop", "head"], in_place=False
    )
    difference = np.max(np.abs(step(rebuilt)[0] - step(plain)[0]))
    assert difference > 1e-3


def test_choose_by_name_predicate_and_in_subclassed_model():
    model = user_model()
    apply_recompute(
        model, ["block_1", lambda layer: layer.name == "head"], in_place=True
    )
    assert [layer.name for layer in recomputed_layers(model)] == [
        "block_1",
        "head",
    ]
    plain, switched = tower(), tower()
    apply_recompute(switched, make_block("probe").__class__, in_place=True)
    assert [layer.name for layer in recomputed_layers(switched)] == [
        "tower_block_0",
        "tower_block_1",
    ]
    assert type(switched) is Tower
    assert_identical(step(switched, compiled=True), step(plain, compiled=True))
    switched.compile(keras.optimizers.SGD(0.1), loss="mse")
    history = switched.fit(X, X[:, :1], batch_size=4, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_choose_by_layer_object():
    """A layer is callable: it must not be taken for a predicate (it was
    called on every layer: "Only input tensors may be passed as positional
    arguments")."""
    model = user_model()
    block = model.get_layer("encoder").get_layer("block_1")
    apply_recompute(model, block)
    assert recomputed_layers(model) == [block]
    strip_recompute(model)
    apply_recompute(model, [block, "head"])
    assert {layer.name for layer in recomputed_layers(model)} == {
        "block_1",
        "head",
    }
    with pytest.raises(
        ValueError, match="holds layer 'stranger', which model 'user_model'"
    ):
        apply_recompute(model, keras.layers.Dense(2, name="stranger"))
    model = user_model()
    rebuilt = apply_recompute(model, model.get_layer("head"), in_place=False)
    assert isinstance(rebuilt.layers[-1], RecomputeGrad)
    assert recomputed_layers(model) == []  # the rebuild leaves it alone


def test_outer_choice_switches_inner_back_and_default_is_top_level():
    model = user_model()
    apply_recompute(model, keras.layers.Dense, in_place=True)
    assert len(recomputed_layers(model)) == 7  # 2 per block + head
    apply_recompute(model, "encoder", in_place=True)
    # The encoder recomputes everything inside it; the head stays switched.
    assert [layer.name for layer in recomputed_layers(model)] == [
        "encoder",
        "head",
    ]
    strip_recompute(model)
    apply_recompute(model, in_place=True)  # layers=None: the top level
    assert [layer.name for layer in recomputed_layers(model)] == [
        "encoder",
        "top_drop",
        "head",
    ]


def _saved_config(path: str) -> str:
    with zipfile.ZipFile(path) as archive:
        return archive.read("config.json").decode()


def test_keras_file_holds_the_plain_model(tmp_path):
    model = user_model()
    apply_recompute(model, keras.Sequential, in_place=True)
    switched_path = os.path.join(tmp_path, "switched.keras")
    model.save(switched_path)
    loaded = keras.models.load_model(switched_path)
    assert type(loaded) is type(model)
    assert recomputed_layers(loaded) == []  # apply again after loading
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), model(X))
    apply_recompute(loaded, keras.Sequential, in_place=True)
    assert len(recomputed_layers(loaded)) == 3
    # Byte for byte the config of the plain model.
    strip_recompute(model)
    plain_path = os.path.join(tmp_path, "plain.keras")
    model.save(plain_path)
    assert _saved_config(switched_path) == _saved_config(plain_path)


def test_model_built_around_a_switched_submodel():
    encoder = user_model().get_layer("encoder")
    apply_recompute(encoder, keras.Sequential, in_place=True)
    inputs = keras.Input((6,))
    outer = keras.Model(inputs, keras.layers.Dense(2)(encoder(inputs)))
    assert len(recomputed_layers(outer)) == 3
    assert outer(X).shape == (8, 2)


class Gated(keras.layers.Layer):
    """A decoder-like block fed a side input (`gate`) besides the stream."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(6, activation="tanh")
        self.dropout = keras.layers.Dropout(0.2)
        self.counter = Counting()

    def call(self, inputs, gate=None, training=None):
        h = self.dropout(self.counter(self.dense(inputs)), training=training)
        return inputs + h * gate


def gated_stack(n: int = 8) -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs, gate = keras.Input((6,), name="x"), keras.Input((6,), name="g")
    h = keras.layers.Dense(6, name="embed")(inputs)
    for i in range(n):
        h = Gated(name=f"gated_{i}")(h, gate=gate)
    return keras.Model([inputs, gate], keras.layers.Dense(1)(h))


def assert_gated_segments_like_plain(model, plain, inputs) -> None:
    """Every Gated unit recomputed, bit-identical to `plain` eagerly and in
    tf.function, each unit run twice per eager step; strip undoes it."""
    assert len(recomputed_layers(model)) == 8
    for i in range(8):
        model.get_layer(f"gated_{i}").counter.calls = 0
    assert_identical(step(model, inputs), step(plain, inputs))
    counts = [model.get_layer(f"gated_{i}").counter.calls for i in range(8)]
    assert counts == [2] * 8  # forward + recomputation
    assert_identical(step(model, inputs, True), step(plain, inputs, True))
    strip_recompute(model)
    assert segment_plan(model) == [] and recomputed_layers(model) == []


def test_sqrt_segments_of_a_stack_with_side_inputs():
    inputs = [X, np.abs(X[::-1])]
    plain, model = gated_stack(), gated_stack()
    apply_recompute(model, Gated, policy="sqrt", in_place=True)
    assert [[layer.name for layer in s] for s in segment_plan(model)] == [
        ["gated_0", "gated_1", "gated_2"],
        ["gated_3", "gated_4", "gated_5"],
        ["gated_6", "gated_7"],
    ]  # ceil(sqrt(8)) = 3 per segment
    assert_gated_segments_like_plain(model, plain, inputs)
    assert "_run_through_graph" not in model.__dict__


def test_min_memory_segments_shrink_towards_the_output():
    """A Gated unit is estimated to hold its 3 leaf layers' outputs (3 x 6
    per sample) and hands on 6: for 8 of them segments of 2, 2, 2, then 1
    and 1 recomputed on their own (8 x 6 stored at most, per unit 10 x 6).
    Bit-identical to the plain model, each unit run twice; strip undoes
    it."""
    inputs = [X, np.abs(X[::-1])]
    plain, model = gated_stack(), gated_stack()
    apply_recompute(model, Gated, policy="min_memory")
    assert [[layer.name for layer in s] for s in segment_plan(model)] == [
        ["gated_0", "gated_1"],
        ["gated_2", "gated_3"],
        ["gated_4", "gated_5"],
    ]
    assert_gated_segments_like_plain(model, plain, inputs)


def test_min_memory_is_in_place_only():
    with pytest.raises(
        ValueError,
        match=r"policy='min_memory' sizes its segments.*pass in_place=True"
        r".*Received: policy='min_memory', in_place=False",
    ):
        apply_recompute(
            gated_stack(), Gated, policy="min_memory", in_place=False
        )
    with pytest.raises(ValueError, match="policy='min_memory' found no run"):
        apply_recompute(tower(), keras.Sequential, policy="min_memory")


def test_sqrt_segments_of_a_sequential_stack():
    def stack():
        keras.utils.set_random_seed(4)
        return keras.Sequential(
            [keras.Input((6,))]
            + [make_block(f"block_{i}") for i in range(4)]
            + [keras.layers.Dense(1)]
        )

    plain, model = stack(), stack()
    apply_recompute(model, keras.Sequential, policy="sqrt", in_place=True)
    assert type(model) is keras.Sequential
    assert [[layer.name for layer in s] for s in segment_plan(model)] == [
        ["block_0", "block_1"],
        ["block_2", "block_3"],
    ]
    assert_identical(step(model, compiled=True), step(plain, compiled=True))


def flat_residual() -> keras.Model:
    """A flat functional model of residual blocks (keras.applications
    style), whose block b1 also feeds the output from its middle."""
    keras.utils.set_random_seed(9)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(6, name="stem")(inputs)
    taps = []
    for b in range(3):
        h = keras.layers.Dense(12, activation="relu", name=f"b{b}_fc1")(x)
        taps.append(h)
        h = keras.layers.Dropout(0.2, name=f"b{b}_drop")(h)
        h = keras.layers.Dense(6, name=f"b{b}_fc2")(h)
        x = keras.layers.Add(name=f"b{b}_add")([x, h])
        x = keras.layers.LayerNormalization(name=f"b{b}_norm")(x)
    x = keras.layers.Concatenate(name="concat")([x, taps[1]])
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def block_key(layer):
    return (
        layer.name.split("_")[0]
        if layer.name[:2] in ("b0", "b1", "b2")
        else None
    )


def test_group_by_recomputes_residual_blocks_of_a_flat_model():
    plain, model = flat_residual(), flat_residual()
    apply_recompute(model, in_place=True, group_by=block_key)
    assert [[layer.name for layer in s] for s in segment_plan(model)] == [
        [f"b{b}_fc1", f"b{b}_drop", f"b{b}_fc2", f"b{b}_add", f"b{b}_norm"]
        for b in range(3)
    ]
    for compiled in (False, True):
        assert_identical(
            step(model, compiled=compiled), step(plain, compiled=compiled)
        )
    # sqrt over the 3 blocks: segments of 2 blocks, then 1.
    strip_recompute(model)
    apply_recompute(model, in_place=True, group_by=block_key, policy="sqrt")
    assert [len(s) for s in segment_plan(model)] == [10, 5]
    assert_identical(step(model, compiled=True), step(plain, compiled=True))


def classifier_around_flat_residual() -> keras.Model:
    """`flat_residual` nested inside a user classifier."""
    body = flat_residual()
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(2, name="cls")(body(inputs)))


def test_group_by_with_default_layers_finds_blocks_in_a_nested_model():
    """layers=None searches the whole tree: the nested model and the head
    map to None, so the blocks inside the nested graph are grouped."""
    plain, model = (
        classifier_around_flat_residual(),
        classifier_around_flat_residual(),
    )
    apply_recompute(model, in_place=True, group_by=block_key)
    body = model.layers[1]
    assert [len(s) for s in segment_plan(body)] == [5, 5, 5]
    assert segment_plan(model) == []
    for compiled in (False, True):
        assert_identical(
            step(model, compiled=compiled), step(plain, compiled=compiled)
        )
    with pytest.raises(
        ValueError,
        match=r"anywhere in its layer tree, nested models included .* "
        r"Received: layers=None, group_by=",
    ):
        apply_recompute(model, in_place=True, group_by=lambda layer: None)


def test_fit_with_jit_compile_and_mixed_precision_matches_plain():
    x, y = np.tile(X, (2, 1)), np.tile(X[:, :1], (2, 1))
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        weights = []
        for switch in (False, True):
            model = user_model()
            if switch:
                apply_recompute(model, keras.Sequential, in_place=True)
            model.compile(
                keras.optimizers.SGD(0.05), loss="mse", jit_compile=True
            )
            model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
            weights.append([np.asarray(w.numpy()) for w in model.weights])
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    for a, b in zip(*weights, strict=True):
        assert np.all(np.isfinite(b))
        # XLA may fuse the two graphs differently.
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)


def test_fit_run_eagerly_trains_like_plain():
    """The eager forward runs with the outer tape paused; the gradients
    (dropout replayed) stay those of the plain model."""
    x, y = np.tile(X, (2, 1)), np.tile(X[:, :1], (2, 1))
    weights = []
    for switch in (False, True):
        model = user_model()
        if switch:
            apply_recompute(model, keras.Sequential, in_place=True)
        model.compile(keras.optimizers.SGD(0.05), loss="mse", run_eagerly=True)
        model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        weights.append([np.asarray(w.numpy()) for w in model.weights])
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "strategy_name", ["default", "mirrored_2", "central_storage"]
)
def test_distributed_gradients_match_plain(strategy_name):
    # The same engine as RecomputeGrad, tested on the whole strategy matrix
    # in test_recompute_grad.py. CentralStorage: Keras itself fails with
    # Dropout there; use deterministic blocks.
    from conftest import make_strategy

    strategy = make_strategy(strategy_name)
    stochastic = strategy_name != "central_storage"
    with strategy.scope():
        plain, model = user_model(stochastic), user_model(stochastic)
        apply_recompute(model, keras.Sequential, in_place=True)
    loss_a, grads_a, states_a = distributed_gradients(strategy, plain, X)
    loss_b, grads_b, states_b = distributed_gradients(strategy, model, X)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for a, b in zip(grads_a + states_a, grads_b + states_b, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_stateful_updates_run_once_per_step_in_fit(strategy_name):
    from _recompute_state import assert_updates_run_once
    from conftest import make_strategy

    assert_updates_run_once(make_strategy(strategy_name), in_place=True)


def test_masks_pass_through():
    ids = np.array([[3, 5, 2, 0, 0], [1, 4, 0, 0, 0]], "int32")

    def build():
        keras.utils.set_random_seed(5)
        inputs = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(8, 6, mask_zero=True)(inputs)
        h = keras.layers.LSTM(4, return_sequences=True, name="lstm")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)  # uses the mask
        return keras.Model(inputs, h)

    plain, model = build(), build()
    apply_recompute(model, "lstm", in_place=True)
    assert_identical(step(model, ids), step(plain, ids))


def test_bad_arguments():
    model = user_model()
    with pytest.raises(TypeError, match="Received: in_place='yes'"):
        apply_recompute(model, in_place="yes")
    with pytest.raises(TypeError, match="Received: group_by=3"):
        apply_recompute(model, in_place=True, group_by=3)
    # Offload needs memory spaces in a jitted step: JAX only.
    with pytest.raises(
        ValueError,
        match="TensorFlow use policy='sqrt'.*offload=True with backend "
        "'tensorflow'",
    ):
        apply_recompute(model, offload=True)
    with pytest.raises(
        ValueError, match="pass in_place=True. Received: group_by"
    ):
        apply_recompute(model, group_by=block_key, in_place=False)
    with pytest.raises(ValueError, match=r"does not have: \['nope'\]"):
        apply_recompute(model, "nope", in_place=True)
    with pytest.raises(ValueError, match="No layer of model 'user_model'"):
        apply_recompute(model, keras.layers.Conv2D, in_place=True)
    # The rebuild reaches the top level only; it says what to do instead.
    with pytest.raises(ValueError, match="nested inside sub-models.*in_place"):
        apply_recompute(model, "block_1", in_place=False)
    with pytest.raises(ValueError, match="3 layers nested inside sub-models"):
        apply_recompute(model, keras.Sequential, in_place=False)
    with pytest.raises(
        ValueError, match="cannot rebuild a subclassed.*in_place"
    ):
        apply_recompute(tower(), in_place=False)
    with pytest.raises(ValueError, match="policy='sqrt' found no run"):
        apply_recompute(tower(), keras.Sequential, policy="sqrt", in_place=True)
    apply_recompute(model, "head", in_place=True)
    with pytest.raises(ValueError, match="has layers recomputed in place"):
        apply_recompute(model, "top_drop", in_place=False)
    with pytest.raises(ValueError, match="already recomputed in place"):
        RecomputeGrad(model.get_layer("head"))
    with pytest.raises(ValueError, match="never chosen"):
        apply_recompute(model, "head", in_place=True)
    dense = model.get_layer("top_drop")
    object.__setattr__(dense, "call", lambda *a, **k: None)
    with pytest.raises(ValueError, match="replaced on the instance"):
        apply_recompute(model, "top_drop", in_place=True)


def test_rebuild_refuses_to_lose_a_functional_subclass():
    class Backbone(keras.Model):  # the shape of a keras-hub backbone
        def __init__(self, width=6, **kwargs):
            inputs = keras.Input((6,))
            outputs = keras.layers.Dense(width, name="proj")(inputs)
            super().__init__(inputs, outputs, **kwargs)
            self.width = width

        def get_config(self):
            return {"width": self.width, "name": self.name}

    backbone = Backbone(name="backbone")
    with pytest.raises(ValueError, match="losing its class Backbone"):
        apply_recompute(backbone, "proj", in_place=False)
    apply_recompute(backbone, "proj", in_place=True)
    assert type(backbone) is Backbone
